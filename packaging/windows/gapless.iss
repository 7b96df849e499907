; Inno Setup 6 script: a per-user Windows installer for the Gapless bundle (no administrator rights needed).
;
; Built by packaging\windows\build.ps1, which first makes the bundle with PyInstaller and then runs
;   ISCC.exe /DAppVersion=0.1.0 /DBundleDir=<repo>\packaging\out\gapless /DIconFile=<repo>\packaging\out\icons\gapless.ico gapless.iss
; Output: packaging\out\gapless-<version>-windows-x64-setup.exe

#ifndef AppVersion
  #error Pass the version: ISCC /DAppVersion=X.Y.Z
#endif
#ifndef BundleDir
  #define BundleDir "..\out\gapless"
#endif

[Setup]
; The AppId identifies the installation for upgrades and the uninstaller; never change it.
AppId={{6A73AAFB-9802-4AFB-A844-2620C6453521}
AppName=Gapless
AppVersion={#AppVersion}
AppVerName=Gapless {#AppVersion}
AppPublisher=Gapless maintainers
; Per user: %LOCALAPPDATA%\Programs\Gapless, Start-menu entry and uninstaller registered for this user only.
PrivilegesRequired=lowest
DefaultDirName={autopf}\Gapless
DefaultGroupName=Gapless
DisableProgramGroupPage=yes
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir=..\out
OutputBaseFilename=gapless-{#AppVersion}-windows-x64-setup
#ifdef IconFile
SetupIconFile={#IconFile}
#endif
UninstallDisplayIcon={app}\gapless.exe
UninstallDisplayName=Gapless
Compression=lzma2
SolidCompression=yes
; A bundle with the CUDA build of torch is several GB. Above 4,200,000,000 bytes compressed Inno Setup requires
; disk spanning (setup.exe plus setup-*.bin files next to it); uncomment for such builds.
; DiskSpanning=yes
WizardStyle=modern
; The licence page: Apache-2.0 (relative paths are from this script's folder, Inno Setup's SourceDir).
LicenseFile=..\..\LICENSE
CloseApplications=yes

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
; The whole one-folder bundle: gapless.exe and _internal\ (Python, torch, Qt, the default model in models\).
Source: "{#BundleDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\Gapless"; Filename: "{app}\gapless.exe"; Parameters: "gui"; WorkingDir: "{app}"; Comment: "Chat with local language models"
Name: "{autodesktop}\Gapless"; Filename: "{app}\gapless.exe"; Parameters: "gui"; WorkingDir: "{app}"; Tasks: desktopicon

[Run]
Filename: "{app}\gapless.exe"; Parameters: "gui"; Description: "{cm:LaunchProgram,Gapless}"; Flags: nowait postinstall skipifsilent

[Code]
// The uninstaller removes what Setup installed. The user's chats, settings, logs and caches live apart, in
// %LOCALAPPDATA%\gapless (the platformdirs folder Gapless uses), and are deleted only when the user says so.
procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  DataDir: String;
begin
  if CurUninstallStep = usPostUninstall then
  begin
    DataDir := ExpandConstant('{localappdata}\gapless');
    if DirExists(DataDir) and not UninstallSilent() then
      if MsgBox('Also delete your Gapless chats, settings, logs and caches?' + #13#10 + DataDir,
                mbConfirmation, MB_YESNO or MB_DEFBUTTON2) = IDYES then
        DelTree(DataDir, True, True, True);
  end;
end;

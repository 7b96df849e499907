# Build the Windows bundle and installer of Gapless, with the default model inside.
#
#   powershell -ExecutionPolicy Bypass -File packaging\windows\build.ps1 [-Python python] [-Iscc ISCC.exe]
#
# Needs: Python 3.11 with Gapless's dependencies and PyInstaller (pip install -e ".[package]"), the torch build
# to bundle (CPU, or CUDA from PyTorch's index), and Inno Setup 6 (https://jrsoftware.org/isinfo.php).
# Produces packaging\out\gapless\ (the bundle) and packaging\out\gapless-<version>-windows-x64-setup.exe.
param(
    [string]$Python = "python",
    [string]$Iscc = "${env:ProgramFiles(x86)}\Inno Setup 6\ISCC.exe"
)
$ErrorActionPreference = "Stop"
$Root = (Resolve-Path "$PSScriptRoot\..\..").Path
$Out = Join-Path $Root "packaging\out"
Set-Location $Root
# The checkout first, then what PYTHONPATH held (as build.sh has it): replacing it hid the folders the user's
# build needs from PyInstaller's and the app's imports.
$env:PYTHONPATH = if ($env:PYTHONPATH) { "$Root;$env:PYTHONPATH" } else { $Root }

function Invoke-Checked([string]$What, [scriptblock]$Command) {
    $result = & $Command
    if ($LASTEXITCODE -ne 0) { throw "$What failed (exit $LASTEXITCODE)" }
    return $result
}

# Before the model's download and the build's minutes: the last step needs it.
if (-not (Test-Path $Iscc)) { throw "Inno Setup's compiler not found at $Iscc (pass -Iscc PATH)" }

$Version = Invoke-Checked "reading the version" { & $Python -c "from app import __version__; print(__version__)" }
if (-not $env:GAPLESS_BUNDLE_MODEL) {
    # The verified copy in the user cache, downloaded once if missing.
    $env:GAPLESS_BUNDLE_MODEL = (Invoke-Checked "fetching the default model" { & $Python -m app models fetch-default }) | Select-Object -Last 1
}
Write-Host "build: Gapless $Version, default model $env:GAPLESS_BUNDLE_MODEL"

Invoke-Checked "rendering the icon" { & $Python packaging\render_icon.py "$Out\icons" } | Out-Null
$env:GAPLESS_BUNDLE_ICON = "$Out\icons\gapless.ico"

$started = Get-Date
Invoke-Checked "PyInstaller" { & $Python -m PyInstaller --noconfirm --log-level WARN --distpath $Out --workpath "$Out\build" packaging\gapless.spec }
Write-Host ("build: bundle built in {0:N0} s" -f ((Get-Date) - $started).TotalSeconds)

$Got = Invoke-Checked "the bundle's --version" { & "$Out\gapless\gapless.exe" --version }
if ($Got -ne "gapless $Version") { throw "the bundle reports '$Got', expected 'gapless $Version'" }

Invoke-Checked "Inno Setup" { & $Iscc "/DAppVersion=$Version" "/DBundleDir=$Out\gapless" "/DIconFile=$Out\icons\gapless.ico" packaging\windows\gapless.iss }
Write-Host "build: installer $Out\gapless-$Version-windows-x64-setup.exe"

#!/usr/bin/env bash
# Install Gapless from this unpacked archive, for the current user (no root needed).
#
#   ./install.sh                  into ${XDG_DATA_HOME:-~/.local/share}/gapless-app, launcher ~/.local/bin/gapless,
#                                 menu entry in ~/.local/share/applications, icon in the hicolor theme
#   ./install.sh --prefix DIR     into DIR/lib/gapless-app, launcher DIR/bin/gapless, DIR/share/applications, DIR/share/icons
#
# Every file, link and folder it creates is written to <app dir>/install-manifest.txt; <app dir>/uninstall.sh
# removes exactly those. An existing Gapless installation in the same place is uninstalled first, and so is what
# an install stopped halfway left (install-unfinished.txt in the app folder says what that made outside it).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: install.sh [--prefix DIR] [--no-desktop] [--force]

  --prefix DIR   install under DIR (DIR/lib/gapless-app, DIR/bin/gapless, DIR/share/...) instead of the
                 per-user locations (~/.local/share/gapless-app, ~/.local/bin/gapless)
  --no-desktop   no menu entry and no icon
  --force        replace a `gapless` launcher or menu entry that another installation put there
EOF
}

say() { printf 'install: %s\n' "$*"; }
die() { printf 'install: error: %s\n' "$*" >&2; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX=""
DESKTOP=1
FORCE=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --prefix) [[ $# -ge 2 ]] || die "--prefix needs a folder"; PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#--prefix=}"; shift ;;
        --no-desktop) DESKTOP=0; shift ;;
        --force) FORCE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

BUNDLE="$HERE/gapless"
SHARE="$HERE/share"
[[ -x "$BUNDLE/gapless" ]] || die "no bundle next to this script ($BUNDLE/gapless); run it from the unpacked archive"
for f in gapless.desktop gapless.svg gapless-256.png VERSION; do
    [[ -f "$SHARE/$f" ]] || die "incomplete archive: $SHARE/$f is missing"
done
VERSION="$(cat "$SHARE/VERSION")"

if [[ -n "$PREFIX" ]]; then
    [[ "$PREFIX" == /* ]] || PREFIX="$PWD/$PREFIX"
    APP_DIR="$PREFIX/lib/gapless-app"
    BIN_DIR="$PREFIX/bin"
    DATA_DIR="$PREFIX/share"
else
    [[ -n "${HOME:-}" ]] || die "HOME is not set"
    DATA_DIR="${XDG_DATA_HOME:-$HOME/.local/share}"
    APP_DIR="$DATA_DIR/gapless-app"
    BIN_DIR="$HOME/.local/bin"
fi
APPS_DIR="$DATA_DIR/applications"
ICONS_DIR="$DATA_DIR/icons/hicolor"
LAUNCHER="$BIN_DIR/gapless"
DESKTOP_FILE="$APPS_DIR/gapless.desktop"
SVG_ICON="$ICONS_DIR/scalable/apps/gapless.svg"
PNG_ICON="$ICONS_DIR/256x256/apps/gapless.png"
MANIFEST="$APP_DIR/install-manifest.txt"
# While an install runs: what it has made outside the app folder so far, in the manifest's format. Only an install
# that was stopped before it finished (killed, the machine went down) leaves it behind.
UNFINISHED="$APP_DIR/install-unfinished.txt"

# The desktop entry quotes the executable's path; these characters would need escaping there, and a newline
# would break the manifest's one-path-per-line format.
case "$APP_DIR$BIN_DIR$DATA_DIR" in
    *[\"\`\$\\]*|*$'\n'*) die "the install path may not contain \" \` \$ \\ or a newline: $APP_DIR" ;;
esac

# ---- what is there already --------------------------------------------------------------------------------

if [[ -f "$MANIFEST" ]]; then
    [[ -x "$APP_DIR/uninstall.sh" ]] || die "$APP_DIR has a manifest but no uninstall.sh; remove it by hand"
    say "replacing the Gapless installation in $APP_DIR"
    "$APP_DIR/uninstall.sh" --quiet
elif [[ -f "$UNFINISHED" ]]; then
    # The app folder was empty or absent when that install began, so all it holds is from it.
    say "removing what an unfinished installation left in $APP_DIR"
    find "$APP_DIR" -mindepth 1 ! -path "$UNFINISHED" -delete
    "$HERE/uninstall.sh" --quiet --manifest "$UNFINISHED"
elif [[ -e "$APP_DIR" ]] && [[ -n "$(ls -A "$APP_DIR" 2>/dev/null)" ]]; then
    die "$APP_DIR exists and was not made by this installer; choose another --prefix or remove it"
fi

# A path outside the app folder that something else owns is only replaced with --force.
claim() {
    local path="$1"
    if [[ -e "$path" || -L "$path" ]]; then
        [[ "$FORCE" == 1 ]] || die "$path already exists (another Gapless installation?); use --force to replace it"
        rm -f -- "$path"
    fi
}
claim "$LAUNCHER"
if [[ "$DESKTOP" == 1 ]]; then
    claim "$DESKTOP_FILE"
    claim "$SVG_ICON"
    claim "$PNG_ICON"
fi

# ---- install, recording every path --------------------------------------------------------------------------

ENTRIES=()  # "d PATH" (a folder this run created), "f PATH" (a file), "l PATH" (a symbolic link)

# The entries outside the app folder, and the app folder's own, to $UNFINISHED (once the app folder is there): a
# later install removes them if this one is stopped. Written before each of them is made.
write_unfinished() {
    [[ -d "$APP_DIR" ]] || return 0
    local e
    {
        for e in "${ENTRIES[@]}"; do
            [[ "${e:2}" == "$APP_DIR/"* ]] || printf '%s\n' "$e"
        done
        printf 'f %s\n' "$UNFINISHED"
    } >"$UNFINISHED.part"
    mv -- "$UNFINISHED.part" "$UNFINISHED"
}

# Record an entry about to be made ("d PATH", "f PATH", "l PATH").
note() {
    ENTRIES+=("$1")
    [[ "${1:2}" == "$APP_DIR/"* ]] || write_unfinished
}

# Create a folder and each missing parent, recording only the ones that did not exist.
make_dir() {
    local dir="$1" missing=()
    while [[ ! -d "$dir" ]]; do
        missing=("$dir" "${missing[@]}")
        dir="$(dirname "$dir")"
    done
    local d
    for d in "${missing[@]}"; do
        note "d $d"
        mkdir -- "$d"
    done
}

put_file() {  # SOURCE DEST MODE
    make_dir "$(dirname "$2")"
    note "f $2"
    install -m "$3" -- "$1" "$2"
}

write_manifest() {
    {
        printf '# Gapless %s, installed %s. Read by uninstall.sh; one entry per line, parents before children.\n' \
            "$VERSION" "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
        printf '%s\n' "${ENTRIES[@]}"
        printf 'f %s\n' "$MANIFEST"
    } >"$MANIFEST.part"
    mv -- "$MANIFEST.part" "$MANIFEST"
}

# If anything below fails or the install is interrupted (Ctrl+C, the terminal closed, kill), undo what was done so
# far: the app folder's contents (it was empty or absent, so all of it is from this run, recorded or not), then
# the recorded paths outside it.
INTERRUPTED=""
rollback() {
    local code=$?
    trap - EXIT INT TERM HUP
    if [[ $code -ne 0 ]]; then
        printf 'install: %s; removing what was installed\n' "${INTERRUPTED:-failed}" >&2
        [[ -d "$APP_DIR" ]] && find "$APP_DIR" -mindepth 1 -delete
        mkdir -p -- "$APP_DIR" && write_manifest && "$HERE/uninstall.sh" --quiet --manifest "$MANIFEST"
    fi
    exit "$code"
}
trap rollback EXIT
trap 'INTERRUPTED=interrupted; exit 130' INT
trap 'INTERRUPTED=interrupted; exit 143' TERM
trap 'INTERRUPTED=interrupted; exit 129' HUP

make_dir "$APP_DIR"
write_unfinished
say "copying the bundle into $APP_DIR"
# One copy of the whole tree, then every folder and file in it recorded (the folders are all new: the app
# folder was empty or absent).
cp -a -- "$BUNDLE/." "$APP_DIR/"
while IFS= read -r -d '' d; do
    ENTRIES+=("d $APP_DIR/${d#./}")
done < <(cd "$BUNDLE" && find . -mindepth 1 -type d -print0 | sort -z)
while IFS= read -r -d '' f; do
    if [[ -L "$BUNDLE/$f" ]]; then ENTRIES+=("l $APP_DIR/${f#./}"); else ENTRIES+=("f $APP_DIR/${f#./}"); fi
done < <(cd "$BUNDLE" && find . -mindepth 1 ! -type d -print0 | sort -z)
put_file "$HERE/uninstall.sh" "$APP_DIR/uninstall.sh" 0755

make_dir "$BIN_DIR"
note "l $LAUNCHER"
ln -s -- "$APP_DIR/gapless" "$LAUNCHER"

if [[ "$DESKTOP" == 1 ]]; then
    put_file "$SHARE/gapless.svg" "$SVG_ICON" 0644
    put_file "$SHARE/gapless-256.png" "$PNG_ICON" 0644
    make_dir "$APPS_DIR"
    # Absolute paths: a desktop session may not have ~/.local/bin on its PATH, and a --prefix icon folder is
    # not in the icon theme's search path.
    # Bash's own replacement, quoted (sed read "&" and "|" in a path as its own, and an unquoted bash
    # replacement reads "&" as the match); in Exec, "%" starts a field code, so a percent sign is "%%".
    entry="$(<"$SHARE/gapless.desktop")"
    exec_path="\"${APP_DIR//\%/%%}/gapless\""
    entry="${entry//@EXEC@/"$exec_path"}"
    entry="${entry//@TRYEXEC@/"$APP_DIR/gapless"}"
    entry="${entry//@ICON@/"$SVG_ICON"}"
    note "f $DESKTOP_FILE"  # before it is written: a failed write is rolled back too
    printf '%s\n' "$entry" >"$DESKTOP_FILE"
    chmod 0644 "$DESKTOP_FILE"
fi

write_manifest
rm -f -- "$UNFINISHED"
trap - EXIT INT TERM HUP

say "installed Gapless $VERSION"
say "  app:      $APP_DIR"
say "  launcher: $LAUNCHER"
[[ "$DESKTOP" == 1 ]] && say "  menu:     $DESKTOP_FILE"
say "  remove:   $APP_DIR/uninstall.sh  (add --purge to also delete chats, settings, logs and caches)"
case ":$PATH:" in
    *":$BIN_DIR:"*) ;;
    *) say "note: $BIN_DIR is not on your PATH; add it, or run $LAUNCHER" ;;
esac

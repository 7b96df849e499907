#!/usr/bin/env bash
# Install Gapless from this unpacked archive, for the current user (no root needed).
#
#   ./install.sh                  into ${XDG_DATA_HOME:-~/.local/share}/gapless-app, launcher ~/.local/bin/gapless,
#                                 menu entry in ~/.local/share/applications, icon in the hicolor theme
#   ./install.sh --prefix DIR     into DIR/lib/gapless-app, launcher DIR/bin/gapless, DIR/share/applications, DIR/share/icons
#
# Every file, link and folder it creates is written to <app dir>/install-manifest.txt; <app dir>/uninstall.sh
# removes exactly those. An existing Gapless installation in the same place is uninstalled first, and so is what
# an install stopped halfway left (install-unfinished.txt in the app folder says what that made). Only those paths
# are removed: what else the app folder holds is left where it is, and named. An app folder that an uninstall left
# because it holds files Gapless did not install (uninstall-left.txt in it says so) is installed into again.
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
# One spelling of each path ("p//lib", "p/" and "p" are one folder): the manifest records them as written here.
tidy() {  # VARIABLE: its path with each "//" one "/" and no "/" at the end
    local p="${!1}"
    while [[ "$p" == *//* ]]; do p="${p//\/\//\/}"; done
    [[ "$p" == "/" ]] || p="${p%/}"
    printf -v "$1" '%s' "$p"
}
tidy APP_DIR
tidy BIN_DIR
tidy DATA_DIR
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
# What an uninstall.sh that left the app folder (it holds files Gapless did not install) says it left there: the
# installer's folders, in the manifest's format.
UNINSTALLED="$APP_DIR/uninstall-left.txt"

# The desktop entry quotes the executable's path; these characters would need escaping there, and a newline
# would break the manifest's one-path-per-line format.
case "$APP_DIR$BIN_DIR$DATA_DIR" in
    *[\"\`\$\\]*|*$'\n'*) die "the install path may not contain \" \` \$ \\ or a newline: $APP_DIR" ;;
esac

# ---- what is there already --------------------------------------------------------------------------------

# The bundle's own paths, relative to it: only these are put into the app folder, and only these (and the folders
# made for them) are removed again. Anything else in the app folder is the user's and stays.
BUNDLE_DIRS=()
BUNDLE_FILES=()  # "f REL" or "l REL"
while IFS= read -r -d '' d; do
    BUNDLE_DIRS+=("${d#./}")
done < <(cd "$BUNDLE" && find . -mindepth 1 -type d -print0 | sort -z)
while IFS= read -r -d '' f; do
    if [[ -L "$BUNDLE/$f" ]]; then BUNDLE_FILES+=("l ${f#./}"); else BUNDLE_FILES+=("f ${f#./}"); fi
done < <(cd "$BUNDLE" && find . -mindepth 1 ! -type d -print0 | sort -z)

# The first ten arguments, comma-separated, and how many more there are.
listing() {
    local out="" n=0 x
    for x in "$@"; do
        if [[ $n -lt 10 ]]; then out+="${out:+, }$x"; fi
        n=$((n + 1))
    done
    if [[ $n -gt 10 ]]; then out+=" and $((n - 10)) more"; fi
    printf '%s' "$out"
}

# What is in the app folder and not from the installer, relative to it: files, links and empty folders.
foreign_in_app() {
    [[ -d "$APP_DIR" ]] || return 0
    local -a found=()
    local p
    while IFS= read -r -d '' p; do
        found+=("${p#./}")
    done < <(cd "$APP_DIR" && find . -mindepth 1 \( ! -type d -o -empty \) ! -path ./install-unfinished.txt \
                 -print0 | sort -z)
    listing "${found[@]}"
}

# The record of an earlier installation here (the manifest of a finished one, the list of an unfinished one):
# its entries are the installer's own; everything else in the app folder is not.
PREVIOUS=""
if [[ -f "$MANIFEST" ]]; then
    [[ -x "$APP_DIR/uninstall.sh" ]] || die "$APP_DIR has a manifest but no uninstall.sh; remove it by hand"
    PREVIOUS="$MANIFEST"
elif [[ -f "$UNFINISHED" ]]; then
    PREVIOUS="$UNFINISHED"
elif [[ -f "$UNINSTALLED" ]]; then
    PREVIOUS="$UNINSTALLED"
elif [[ -e "$APP_DIR" ]] && [[ -n "$(ls -A "$APP_DIR" 2>/dev/null)" ]]; then
    die "$APP_DIR exists and was not made by this installer; choose another --prefix or remove it"
fi

# "listed" where the record of an earlier installation lists what it made in the app folder too (a manifest, the
# unfinished list of this version); "" for the unfinished list of an earlier version, which did not.
FORMAT=listed
ENTRIES=()  # "d PATH" (a folder this run created), "f PATH" (a file), "l PATH" (a symbolic link)
declare -A CLAIMED=()  # the folders among ENTRIES
if [[ -n "$PREVIOUS" ]]; then
    # The record names the app folder as the installation that wrote it spelled it (another --prefix spelling,
    # another HOME or XDG_DATA_HOME): its entries inside it are compared by their path relative to it.
    RECORDED_APP="$APP_DIR"
    [[ "$PREVIOUS" != "$UNFINISHED" ]] || FORMAT=""  # listed again below where the list says it is of this kind
    while IFS= read -r line || [[ -n "$line" ]]; do
        case "$line" in
            "# An unfinished Gapless installation"*) FORMAT=listed ;;
            "f /"*"/${PREVIOUS##*/}") RECORDED_APP="${line:2}"; RECORDED_APP="${RECORDED_APP%/*}"; tidy RECORDED_APP ;;
        esac
    done <"$PREVIOUS"
    declare -A OURS=()  # relative to the app folder inside it, absolute outside
    PREVIOUS_DIRS=()
    while IFS= read -r line || [[ -n "$line" ]]; do
        case "$line" in
            "f /"*|"l /"*|"d /"*)
                path="${line:2}"
                tidy path
                if [[ "$path" == "$RECORDED_APP" ]]; then
                    path="$APP_DIR"
                elif [[ "$path" == "$RECORDED_APP/"* ]]; then
                    path="$APP_DIR/${path#"$RECORDED_APP/"}"
                fi
                OURS["$path"]="${line:0:1}"
                [[ "${line:0:1}" != d ]] || PREVIOUS_DIRS+=("$path")
                ;;
        esac
    done <"$PREVIOUS"
    # A path of this bundle's that something other than the installer put there would be overwritten, and then
    # removed with the installation: refused before anything is removed. The list an unfinished install of an
    # earlier version left names only what it made outside the app folder (that version cleared the whole app
    # folder): the bundle's paths in it are that install's half-made copy, and this one copies over them.
    # A link where the record has a file or a folder (the user's own models folder linked in place of
    # _internal/models, say), or a file where it has a link, is the user's too: the removal and the copy would go
    # through it, into what it points to.
    # A folder of the installation's where this version has a file or a link is the installation's as long as all
    # it holds is (the uninstall removes it then).
    only_ours() {
        local p
        while IFS= read -r -d '' p; do
            [[ -n "${OURS[$p]:-}" ]] || return 1
        done < <(find "$1" -mindepth 1 -print0)
    }
    clash=()
    if [[ "$FORMAT" == listed ]]; then
        for e in "${BUNDLE_FILES[@]}"; do
            path="$APP_DIR/${e:2}"
            if [[ -L "$path" ]]; then
                [[ "${OURS[$path]:-}" == l ]] || clash+=("${e:2}")
            elif [[ -d "$path" ]]; then
                [[ "${OURS[$path]:-}" == d ]] && only_ours "$path" || clash+=("${e:2}")
            elif [[ -e "$path" ]]; then
                [[ "${OURS[$path]:-}" == f ]] || clash+=("${e:2}")
            fi
        done
        for d in "${BUNDLE_DIRS[@]}"; do
            path="$APP_DIR/$d"
            if [[ -L "$path" ]]; then
                [[ "${OURS[$path]:-}" == l ]] || clash+=("$d")
            elif [[ -e "$path" && ! -d "$path" ]]; then
                [[ "${OURS[$path]:-}" == f ]] || clash+=("$d")
            fi
        done
    fi
    if [[ ${#clash[@]} -gt 0 ]]; then
        die "$APP_DIR holds files Gapless did not install where this version installs its own:" \
            "$(listing "${clash[@]}"); move them out of the app folder, then run install.sh again"
    fi
    # So is a launcher or menu entry that this installation did not make (claimed below): refused after the
    # removal, it left no installation, and an app folder with the user's files and no record of it.
    # One is the installation's only while it is what was recorded (a link, a file): the uninstall leaves a script
    # of the user's in place of the launcher, or a link in place of the menu entry, and the refusal then came
    # after the removal.
    theirs=("$LAUNCHER")
    [[ "$DESKTOP" != 1 ]] || theirs+=("$DESKTOP_FILE" "$SVG_ICON" "$PNG_ICON")
    for path in "${theirs[@]}"; do
        [[ -e "$path" || -L "$path" ]] || continue
        case "${OURS[$path]:-}" in
            l) [[ -L "$path" ]] && continue ;;
            f) [[ -f "$path" && ! -L "$path" ]] && continue ;;
        esac
        [[ "$FORCE" == 1 ]] || die "$path already exists (another Gapless installation?); use --force to replace it"
    done
    if [[ "$PREVIOUS" == "$MANIFEST" ]]; then
        say "replacing the Gapless installation in $APP_DIR"
        "$APP_DIR/uninstall.sh" --quiet
    elif [[ "$PREVIOUS" == "$UNFINISHED" ]]; then
        say "removing what an unfinished installation left in $APP_DIR"
        "$HERE/uninstall.sh" --quiet --manifest "$UNFINISHED"
    else
        say "installing into $APP_DIR, which an earlier uninstall.sh left for the files Gapless did not install"
    fi
    rm -f -- "$UNINSTALLED"  # (the uninstall above leaves one where the app folder stays; this install goes on)
    # The folders that installation made and that stay because something else is in them are still the
    # installer's: this one records them again, so that they go once they are empty.
    for d in "${PREVIOUS_DIRS[@]}"; do
        [[ -d "$d" && ! -L "$d" ]] || continue
        ENTRIES+=("d $d")
        CLAIMED["$d"]=1
    done
    left="$(foreign_in_app)"  # (after an earlier version's unfinished install, its half-made copy is among it)
    [[ -z "$left" || "$FORMAT" != listed ]] || say "kept in $APP_DIR what Gapless did not install: $left"
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

# Every entry so far to $UNFINISHED (once the app folder is there), in the manifest's format: a later install
# removes them if this one is stopped. Written before the bundle is copied and before each path outside the app
# folder is made.
write_unfinished() {
    [[ -d "$APP_DIR" ]] || return 0
    {
        printf '# An unfinished Gapless installation: what it made. Read by the next install.sh.\n'
        [[ ${#ENTRIES[@]} -eq 0 ]] || printf '%s\n' "${ENTRIES[@]}"
        printf 'f %s\n' "$UNFINISHED"
    } >"$UNFINISHED.part"
    mv -- "$UNFINISHED.part" "$UNFINISHED"
}

# Record an entry about to be made ("d PATH", "f PATH", "l PATH").
note() {
    ENTRIES+=("$1")
    if [[ "${1:0:1}" == d ]]; then CLAIMED["${1:2}"]=1; fi
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
# far: every recorded path, the bundle's among them (recorded before the copy, so a half-made copy goes too).
# What else the app folder holds is not the installer's and stays; the folders that hold it are written to
# $UNFINISHED, which the next install reads as its own.
INTERRUPTED=""
rollback() {
    local code=$?
    trap - EXIT INT TERM HUP
    if [[ $code -ne 0 ]]; then
        printf 'install: %s; removing what was installed\n' "${INTERRUPTED:-failed}" >&2
        rm -f -- "$UNFINISHED" "$UNFINISHED.part" "$MANIFEST.part"
        if mkdir -p -- "$APP_DIR" && write_manifest; then
            "$HERE/uninstall.sh" --quiet --manifest "$MANIFEST" ||
                printf 'install: error: not all of it could be removed (above: what was left)\n' >&2
            rm -f -- "$UNINSTALLED"  # $UNFINISHED, below, is the record of what stays
        fi
        if [[ -d "$APP_DIR" ]]; then
            local left e kept=()
            left="$(foreign_in_app)"
            for e in "${ENTRIES[@]}"; do
                [[ "$e" == "d /"* && -d "${e:2}" && ! -L "${e:2}" ]] && kept+=("$e")
            done
            ENTRIES=("${kept[@]}")
            [[ ${#kept[@]} -eq 0 ]] || write_unfinished
            [[ -z "$left" ]] || printf 'install: left in %s what Gapless did not install: %s\n' "$APP_DIR" "$left" >&2
        fi
    fi
    exit "$code"
}
trap rollback EXIT
trap 'INTERRUPTED=interrupted; exit 130' INT
trap 'INTERRUPTED=interrupted; exit 143' TERM
trap 'INTERRUPTED=interrupted; exit 129' HUP

make_dir "$APP_DIR"
# Every folder and file of the bundle recorded before one of them is copied. The folders are the ones not there
# yet: one the user made, or one the installation before this left (it holds the user's files), is not made
# again.
# The list an earlier version's unfinished install left does not name its half-made copy: the bundle's folders
# there are that copy's, and this install's now.
for d in "${BUNDLE_DIRS[@]}"; do
    path="$APP_DIR/$d"
    [[ -n "${CLAIMED[$path]:-}" ]] && continue
    [[ -d "$path" && "$FORMAT" == listed ]] || ENTRIES+=("d $path")
done
for e in "${BUNDLE_FILES[@]}"; do
    ENTRIES+=("${e:0:1} $APP_DIR/${e:2}")
done
write_unfinished
say "copying the bundle into $APP_DIR"
cp -a -- "$BUNDLE/." "$APP_DIR/"
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

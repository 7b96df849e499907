#!/usr/bin/env bash
# Remove Gapless as install.sh installed it: exactly the files, links and folders listed in the manifest
# (install-manifest.txt next to this script). The user's chats, settings, logs and caches stay unless --purge.
# Where the app folder stays because it holds files Gapless did not install, uninstall-left.txt in it names the
# folders the installer made that stay: the next install.sh there takes them back and keeps those files.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: uninstall.sh [--purge] [--quiet] [--manifest FILE]

  --purge          also delete your Gapless chats, settings, logs and caches:
                   ${XDG_DATA_HOME:-~/.local/share}/gapless, ${XDG_CONFIG_HOME:-~/.config}/gapless,
                   ${XDG_STATE_HOME:-~/.local/state}/gapless, ${XDG_CACHE_HOME:-~/.cache}/gapless
  --quiet          print only problems
  --manifest FILE  the manifest to follow (default: install-manifest.txt next to this script)
EOF
}

PURGE=0
QUIET=0
MANIFEST="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/install-manifest.txt"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --purge) PURGE=1; shift ;;
        --quiet) QUIET=1; shift ;;
        --manifest) [[ $# -ge 2 ]] || { usage >&2; exit 2; }; MANIFEST="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; printf 'uninstall: error: unknown option: %s\n' "$1" >&2; exit 2 ;;
    esac
done

say() { [[ "$QUIET" == 1 ]] || printf 'uninstall: %s\n' "$*"; }
warn() { printf 'uninstall: %s\n' "$*" >&2; }

[[ -f "$MANIFEST" ]] || { warn "error: no manifest at $MANIFEST; nothing removed"; exit 1; }
APP_DIR="$(cd "$(dirname "$MANIFEST")" && pwd)"
if [[ "$PURGE" == 1 && -z "${HOME:-}" ]]; then
    warn "error: HOME is not set, so the user data folders are unknown; nothing removed"
    exit 1
fi

# Read it all first: the manifest and this script are among the entries.
FILES=()  # "f PATH" (a file) or "l PATH" (a symbolic link)
DIRS=()
while IFS= read -r line || [[ -n "$line" ]]; do
    case "$line" in
        "f /"*|"l /"*) FILES+=("$line") ;;
        "d /"*) DIRS+=("${line:2}") ;;
        ""|"#"*) ;;
        *) warn "error: unexpected manifest line: $line"; exit 1 ;;
    esac
done <"$MANIFEST"
# The app folder as the install spelled it: the folder of the manifest's own entry.
RECORDED_APP="$APP_DIR"
for entry in "${FILES[@]}"; do
    [[ "$entry" == *"/${MANIFEST##*/}" ]] && RECORDED_APP="${entry:2}" && RECORDED_APP="${RECORDED_APP%/*}"
done
# The manifest names paths as the install spelled them. Reached another way (a folder above the app folder
# linked, or its link resolved), the app folder takes the manifest's spelling: otherwise no path found in it
# matched the manifest's, and files were removed through a link the user put in it.
if [[ "$RECORDED_APP" != "$APP_DIR" && "$(cd "$RECORDED_APP" 2>/dev/null && pwd -P)" == "$(cd "$APP_DIR" && pwd -P)" ]]
then
    APP_DIR="$RECORDED_APP"
    MANIFEST="$APP_DIR/${MANIFEST##*/}"
fi

removed=0
kept=()
# A link to a folder where the installer made a folder (the user's own models folder in place of
# _internal/models, say), or anywhere else in the app folder: nothing is removed through it, since what it points
# to is not the installer's. The link stays, and is named. The app folder itself, and the folders above it, are
# where this manifest was found: what is in them is the installation's, however they are reached.
LINK_NOTE="a link Gapless did not make; it and what it points to are left as they are"
declare -A OWN_LINKS=()
for entry in "${FILES[@]}"; do
    [[ "${entry:0:1}" == l ]] && OWN_LINKS["${entry:2}"]=1
done
declare -A LINKED=()  # the link's path: "d" where the manifest lists a folder there, "" until something is under it
for path in "${DIRS[@]}"; do  # (outside the app folder, ~/.local/bin made a link to a dotfiles folder, say, the
    # launcher recorded in it is still the installation's own link and goes)
    [[ -L "$path" && "$path/" == "$APP_DIR/"* ]] && LINKED["$path"]=d
done
if [[ -d "$APP_DIR" && ! -L "$APP_DIR" ]]; then
    while IFS= read -r -d '' path; do
        [[ -d "$path" && -z "${OWN_LINKS[$path]:-}" && -z "${LINKED[$path]:-}" ]] && LINKED["$path"]=""
    done < <(find "$APP_DIR" -mindepth 1 -type l -print0)
fi
through_link() {  # PATH: whether a folder above it is one of LINKED (which is then named)
    local link
    for link in "${!LINKED[@]}"; do
        if [[ "$1" == "$link/"* ]]; then
            [[ -n "${LINKED[$link]}" ]] || LINKED["$link"]=under
            return 0
        fi
    done
    return 1
}
doomed=()
for entry in "${FILES[@]}"; do
    path="${entry:2}"
    [[ "$path" == "$MANIFEST" ]] && continue  # last, so an interrupted run can be repeated
    [[ ${#LINKED[@]} -gt 0 ]] && through_link "$path" && continue
    if [[ "${entry:0:1}" == l ]]; then
        if [[ -L "$path" ]]; then
            doomed+=("$path")
        elif [[ -e "$path" ]]; then
            kept+=("$path (no longer a link)")
        fi
    elif [[ -L "$path" ]]; then
        kept+=("$path ($LINK_NOTE)")
    elif [[ -f "$path" ]]; then
        doomed+=("$path")
    elif [[ -e "$path" ]]; then
        kept+=("$path (no longer a file)")
    fi
done
if [[ ${#LINKED[@]} -gt 0 ]]; then
    for path in "${DIRS[@]}"; do
        through_link "$path" || true
    done
    while IFS= read -r -d '' path; do
        [[ -z "${LINKED[$path]}" ]] || kept+=("$path ($LINK_NOTE)")
    done < <(printf '%s\0' "${!LINKED[@]}" | sort -z)
fi
# One rm per few thousand paths rather than one per file: a bundle has about 7000.
if [[ ${#doomed[@]} -gt 0 ]]; then
    printf '%s\0' "${doomed[@]}" | xargs -0 rm -f --
    removed=${#doomed[@]}
fi
rm -f -- "$MANIFEST"
USER_DIRS=()
if [[ -n "${HOME:-}" ]]; then
    USER_DIRS=("${XDG_DATA_HOME:-$HOME/.local/share}/gapless" "${XDG_CONFIG_HOME:-$HOME/.config}/gapless"
               "${XDG_STATE_HOME:-$HOME/.local/state}/gapless" "${XDG_CACHE_HOME:-$HOME/.cache}/gapless")
fi
if [[ "$PURGE" == 1 ]]; then
    for dir in "${USER_DIRS[@]}"; do
        if [[ -e "$dir" ]]; then
            rm -rf -- "$dir"
            say "deleted $dir"
        fi
    done
fi

# Folders last, after a purge, so that a folder the installer created and the user data shared is removed too
# once empty. A folder that still holds something is left; that is only worth a word inside the app folder
# (~/.local/share, say, holds other applications' files as a rule).
STAYED=()  # the installer's folders that stay, children before parents
for ((i = ${#DIRS[@]} - 1; i >= 0; i--)); do
    path="${DIRS[i]}"
    [[ -d "$path" && ! -L "$path" ]] || continue
    [[ ${#LINKED[@]} -gt 0 ]] && through_link "$path" && continue
    if rmdir -- "$path" 2>/dev/null; then
        removed=$((removed + 1))
    else
        STAYED+=("$path")
        [[ "$path/" != "$APP_DIR/"* ]] || kept+=("$path (holds files Gapless did not install)")
    fi
done
# The app folder that stays is still Gapless's: without a record of it, the next install refused it as a folder
# "not made by this installer". The record names itself as the manifest did its own folder (install.sh compares
# the entries inside the app folder by their path in it).
if [[ -d "$APP_DIR" && ! -L "$APP_DIR" && -n "$(ls -A -- "$APP_DIR")" ]]; then
    {
        printf '# What a Gapless uninstall left: the folders install.sh made that hold files it did not install.\n'
        printf '# Read by the next install.sh here, which takes them back and keeps those files.\n'
        for ((i = ${#STAYED[@]} - 1; i >= 0; i--)); do
            printf 'd %s\n' "${STAYED[i]}"
        done
        printf 'f %s\n' "$RECORDED_APP/uninstall-left.txt"
    } >"$APP_DIR/uninstall-left.txt.part"
    mv -- "$APP_DIR/uninstall-left.txt.part" "$APP_DIR/uninstall-left.txt"
fi
say "removed $removed installed files and folders"
for k in "${kept[@]}"; do
    warn "left $k"
done
if [[ "$PURGE" != 1 ]]; then
    left=()
    for dir in "${USER_DIRS[@]}"; do
        [[ -e "$dir" ]] && left+=("$dir")
    done
    if [[ ${#left[@]} -gt 0 ]]; then
        say "kept your chats, settings, logs and caches: ${left[*]} (uninstall.sh --purge deletes them)"
    fi
fi

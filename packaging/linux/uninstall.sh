#!/usr/bin/env bash
# Remove Gapless as install.sh installed it: exactly the files, links and folders listed in the manifest
# (install-manifest.txt next to this script). The user's chats, settings, logs and caches stay unless --purge.
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
FILES=()
DIRS=()
while IFS= read -r line || [[ -n "$line" ]]; do
    case "$line" in
        "f /"*|"l /"*) FILES+=("${line:2}") ;;
        "d /"*) DIRS+=("${line:2}") ;;
        ""|"#"*) ;;
        *) warn "error: unexpected manifest line: $line"; exit 1 ;;
    esac
done <"$MANIFEST"

removed=0
kept=()
doomed=()
for path in "${FILES[@]}"; do
    [[ "$path" == "$MANIFEST" ]] && continue  # last, so an interrupted run can be repeated
    if [[ -L "$path" || -f "$path" ]]; then
        doomed+=("$path")
    elif [[ -e "$path" ]]; then
        kept+=("$path (no longer a file)")
    fi
done
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
for ((i = ${#DIRS[@]} - 1; i >= 0; i--)); do
    path="${DIRS[i]}"
    [[ -d "$path" && ! -L "$path" ]] || continue
    if rmdir -- "$path" 2>/dev/null; then
        removed=$((removed + 1))
    elif [[ "$path/" == "$APP_DIR/"* ]]; then
        kept+=("$path (holds files Gapless did not install)")
    fi
done
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

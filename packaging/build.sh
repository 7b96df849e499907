#!/usr/bin/env bash
# Build the Linux bundle and installer archive of Gapless, with the default model inside.
#
#   packaging/build.sh [--no-archive | --archive-only]
#
# with the project's Python environment active and PyInstaller installed. --no-archive stops after the bundle;
# --archive-only packs the bundle already in packaging/out/gapless.
#
# Produces
#   packaging/out/gapless/                                  the one-folder bundle (run ./gapless)
#   packaging/out/gapless-<version>-linux-<arch>.tar.gz     bundle + install.sh + uninstall.sh + desktop entry + icons
#
# Environment
#   PYTHON                 the interpreter to build with (default: the checkout's .venv/bin/python where it
#                          exists, else python3); its torch build is the one bundled
#   GAPLESS_BUNDLE_MODEL   use this default-model GGUF instead of `python -m app models fetch-default`
set -euo pipefail

BUNDLE_STEP=1
ARCHIVE_STEP=1
case "${1:-}" in
    "") ;;
    --no-archive) ARCHIVE_STEP=0 ;;
    --archive-only) BUNDLE_STEP=0 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) printf 'build: error: unknown option %s\n' "$1" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/packaging/out"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

say() { printf 'build: %s\n' "$*" >&2; }
die() { printf 'build: error: %s\n' "$*" >&2; exit 1; }

cd "$ROOT"
"$PYTHON" -c "import PyInstaller" 2>/dev/null || die "PyInstaller is not installed for $PYTHON (pip install -e '.[package]')"
VERSION="$("$PYTHON" -c 'from app import __version__; print(__version__)')"
ARCH="$(uname -m)"
TORCH="$("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA " + torch.version.cuda if torch.version.cuda else "CPU only")')"
say "Gapless $VERSION for linux-$ARCH, torch $TORCH"

if [[ "$BUNDLE_STEP" == 1 ]]; then
    # The default model: the verified copy in the user cache, downloaded once if missing (the only network use).
    if [[ -z "${GAPLESS_BUNDLE_MODEL:-}" ]]; then
        say "locating the default model"
        GAPLESS_BUNDLE_MODEL="$("$PYTHON" -m app models fetch-default | tail -n 1)"
    fi
    [[ -f "$GAPLESS_BUNDLE_MODEL" ]] || die "default model not found: $GAPLESS_BUNDLE_MODEL"
    export GAPLESS_BUNDLE_MODEL
    say "default model: $GAPLESS_BUNDLE_MODEL"

    mkdir -p "$OUT"
    "$PYTHON" packaging/render_icon.py "$OUT/icons" >/dev/null

    started=$SECONDS
    say "running PyInstaller (several minutes: torch and transformers are large)"
    "$PYTHON" -m PyInstaller --noconfirm --log-level WARN \
        --distpath "$OUT" --workpath "$OUT/build" packaging/gapless.spec
    say "bundle built in $((SECONDS - started)) s"
fi

BUNDLE="$OUT/gapless"
[[ -x "$BUNDLE/gapless" ]] || die "PyInstaller did not produce $BUNDLE/gapless"
got="$("$BUNDLE/gapless" --version)"
[[ "$got" == "gapless $VERSION" ]] || die "the bundle reports '$got', expected 'gapless $VERSION'"
say "bundle: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1)), $got"

if [[ "$ARCHIVE_STEP" == 0 ]]; then
    exit 0
fi

# The archive: one top folder holding the bundle and the installer files next to it.
NAME="gapless-$VERSION-linux-$ARCH"
STAGE="$OUT/installer"
rm -rf "$STAGE"
mkdir -p "$STAGE/share"
install -m 0755 packaging/linux/install.sh packaging/linux/uninstall.sh "$STAGE/"
install -m 0644 packaging/linux/gapless.desktop assets/gapless.svg "$OUT/icons/gapless-256.png" "$STAGE/share/"
printf '%s\n' "$VERSION" >"$STAGE/share/VERSION"
install -m 0644 packaging/linux/README.txt "$STAGE/README.txt"
install -m 0644 LICENSE NOTICE "$STAGE/"

started=$SECONDS
ARCHIVE="$OUT/$NAME.tar.gz"
say "writing $ARCHIVE"
# Only member names are renamed (flags=r), never the targets of the bundle's relative symbolic links.
tar --create --gzip --file "$ARCHIVE.part" --owner=0 --group=0 --numeric-owner \
    --transform "flags=r;s,^\./,$NAME/," \
    -C "$STAGE" ./install.sh ./uninstall.sh ./README.txt ./LICENSE ./NOTICE ./share \
    -C "$OUT" ./gapless
mv "$ARCHIVE.part" "$ARCHIVE"
say "archive: $ARCHIVE ($(du -sh "$ARCHIVE" | cut -f1)) in $((SECONDS - started)) s"

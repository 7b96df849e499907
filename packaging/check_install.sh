#!/usr/bin/env bash
# End-to-end check of the Linux installer, in one command:
#   build (or reuse with --no-build) -> unpack the archive -> install.sh into a temporary prefix ->
#   the installed launcher runs `gui --smoke-test` offscreen with no network -> the report holds an answer from
#   the bundled model -> uninstall.sh -> nothing is left but the user's data.
#
#   packaging/check_install.sh [--no-build] [--keep]
#
# Everything happens under one temporary folder with its own HOME, so the user's real Gapless data, caches
# and menu are never touched. The network is cut with `unshare -n` (a network namespace with no interfaces)
# where the kernel allows it (root, or unprivileged user namespaces); otherwise the proxies point to a closed
# local port and the Hugging Face libraries are set offline, which stops every HTTP request Gapless can make.
# Takes the build time (see packaging/README.md) plus about 2 minutes on a busy 2-core machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/packaging/out"
BUILD=1
KEEP=0
for arg in "$@"; do
    case "$arg" in
        --no-build) BUILD=0 ;;
        --keep) KEEP=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) printf 'check: error: unknown option %s\n' "$arg" >&2; exit 2 ;;
    esac
done

T0=$SECONDS
step_start=$SECONDS
say() { printf 'check: %s\n' "$*"; }
fail() { printf 'check: FAILED: %s\n' "$*" >&2; exit 1; }
took() { say "$1 ($((SECONDS - step_start)) s)"; step_start=$SECONDS; }

if [[ "$BUILD" == 1 ]]; then
    "$ROOT/packaging/build.sh"
    took "built the bundle and the archive"
fi
VERSION="$(cd "$ROOT" && PYTHONPATH="$ROOT" "${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}" -c 'from app import __version__; print(__version__)')"
NAME="gapless-$VERSION-linux-$(uname -m)"
ARCHIVE="$OUT/$NAME.tar.gz"
[[ -f "$ARCHIVE" ]] || fail "no archive at $ARCHIVE (run without --no-build)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/gapless-check.XXXXXX")"
cleanup() {
    if [[ "$KEEP" == 1 ]]; then say "kept $WORK"; else rm -rf -- "$WORK"; fi
}
trap cleanup EXIT
HOME_DIR="$WORK/home"
PREFIX="$WORK/prefix"
mkdir -p "$HOME_DIR" "$PREFIX" "$WORK/unpacked" "$WORK/results"

tar -xzf "$ARCHIVE" -C "$WORK/unpacked"
took "unpacked $ARCHIVE ($(du -sh "$ARCHIVE" | cut -f1))"

# A clean environment: no virtualenv, no PYTHONPATH, no GAPLESS_* overrides, nothing from the build machine.
run_user() {
    env -i HOME="$HOME_DIR" PATH="$PREFIX/bin:/usr/bin:/bin" LANG=C.UTF-8 "$@"
}
run_user "$WORK/unpacked/$NAME/install.sh" --prefix "$PREFIX"
took "installed into $PREFIX ($(du -sh "$PREFIX" | cut -f1))"

LAUNCHER="$PREFIX/bin/gapless"
got="$(run_user "$LAUNCHER" --version)"
[[ "$got" == "gapless $VERSION" ]] || fail "the launcher says '$got', expected 'gapless $VERSION'"
say "the launcher answers: $got"

REPORT="$WORK/results/report.json"
SHOT="$WORK/results/screenshot.png"
NET_CMD=()
NET_ENV=()
if unshare -n true 2>/dev/null; then
    NET="unshare -n (no network interfaces)"
    NET_CMD=(unshare -n)
elif unshare -r -n true 2>/dev/null; then
    NET="unshare -r -n (user namespace, no network interfaces)"
    NET_CMD=(unshare -r -n)
else
    NET="proxies to a closed port, Hugging Face offline (unshare is not permitted here)"
    NET_ENV=(http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9
             HTTPS_PROXY=http://127.0.0.1:9 no_proxy= NO_PROXY= HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1)
fi
say "smoke test of the installed app, offscreen, network cut by: $NET"
set +e
"${NET_CMD[@]}" env -i HOME="$HOME_DIR" PATH="$PREFIX/bin:/usr/bin:/bin" LANG=C.UTF-8 QT_QPA_PLATFORM=offscreen \
    "${NET_ENV[@]}" timeout 1800 "$LAUNCHER" gui --smoke-test --report "$REPORT" --screenshot "$SHOT" \
    >"$WORK/results/smoke.out" 2>"$WORK/results/smoke.err"
code=$?
set -e
took "smoke test exited $code"
if [[ $code -ne 0 ]]; then
    tail -n 30 "$WORK/results/smoke.err" >&2
    KEEP=1
    fail "the installed app's smoke test exited $code"
fi

# The answer must come from the bundled model: with an empty HOME there is no other copy, and no network.
MODEL_DIR="$(realpath "$PREFIX")/lib/gapless-app/_internal/models"  # the engine reports the resolved path
python3 - "$REPORT" "$SHOT" "$MODEL_DIR" <<'EOF' || { KEEP=1; fail "the smoke report does not show an answer from the bundled model"; }
import json, sys
from pathlib import Path

report = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
shot, model_dir = Path(sys.argv[2]), Path(sys.argv[3])
answer = (report.get("answer") or "").strip()
source = str((report.get("model") or {}).get("source") or "")
problems = []
if report.get("ok") is not True:
    problems.append("ok is not true")
if not answer:
    problems.append("the answer is empty")
if not source.startswith(str(model_dir)):
    problems.append(f"the model came from {source!r}, not {model_dir}")
if not shot.is_file() or shot.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
    problems.append(f"no PNG screenshot at {shot}")
for p in problems:
    print(f"check: {p}", file=sys.stderr)
print(f"check: answer: {answer!r}")
print(f"check: model: {source}")
print(f"check: load {report['seconds']['load']} s, answer {report['seconds']['answer']} s; {report.get('stats_line')}")
sys.exit(1 if problems else 0)
EOF

run_user "$PREFIX/lib/gapless-app/uninstall.sh"
took "uninstalled"

# Nothing may be left in the prefix (the check made it, the installer only filled it), and under HOME only the
# user's Gapless data: chats, settings, logs and caches in the XDG folders.
left="$(find "$PREFIX" -mindepth 1 | head -n 20)"
[[ -z "$left" ]] || { KEEP=1; fail "left in the prefix after uninstall:
$left"; }
stray="$(cd "$HOME_DIR" && find . -mindepth 1 \
    ! -path ./.local ! -path ./.local/share ! -path ./.local/state ! -path ./.config ! -path ./.cache \
    ! -path './.local/share/gapless' ! -path './.local/share/gapless/*' \
    ! -path './.local/state/gapless' ! -path './.local/state/gapless/*' \
    ! -path './.config/gapless' ! -path './.config/gapless/*' \
    ! -path './.cache/gapless' ! -path './.cache/gapless/*' | head -n 20)"
[[ -z "$stray" ]] || { KEEP=1; fail "left under HOME besides the user's data:
$stray"; }
say "user data kept: $(cd "$HOME_DIR" && find . -mindepth 2 -maxdepth 3 -type d -name gapless | sort | tr '\n' ' ')"

say "PASSED in $((SECONDS - T0)) s: build/reuse, install, offscreen smoke test with no network, uninstall"

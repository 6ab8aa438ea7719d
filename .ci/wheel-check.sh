#!/usr/bin/env bash
# The package as a user installs it: a wheel built from the checkout, installed (not editable)
# into a fresh venv, and run from outside the checkout. The venv takes torch, fairseq and the
# other dependencies from $VENV (default .venv, which `make test` has set up) through a .pth
# file added after the install: nothing of the checkout is on its path, and pip never sees
# $VENV's editable install of the package.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${VENV:-.venv}
PY=$REPO/$VENV/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# the working tree's files (tracked, and new ones not ignored), none of its build outputs
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard \
    | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$WORK/src"
(cd "$WORK/src" && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" .)
WHEEL=$(ls "$WORK"/dist/fairseq_pardec-*.whl)
unzip -l "$WHEEL" | grep -q "fairseq_pardec/native/libpardec_native.so" \
    || { echo "wheel check: FAILED: $WHEEL holds no native library" >&2; exit 1; }

"$PY" -m venv --without-pip "$WORK/venv"
"$PY" -m pip --python "$WORK/venv/bin/python" install -q --no-deps --no-index "$WHEEL"
SITE=$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DEPS=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$DEPS" > "$SITE/zz_dependencies.pth"  # after the wheel's own files on sys.path

mkdir -p "$WORK/run" "$WORK/cache"
cd "$WORK/run"
FAIRSEQ_PARDEC_CACHE="$WORK/cache" "$WORK/venv/bin/python" -P "$REPO/.ci/wheel_check.py" "$REPO"

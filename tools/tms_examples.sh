#!/usr/bin/env bash
# torch_memory_saver's own example suite (its test/test_examples.py with test/examples/) run
# against our torch_memory_saver alias ("ours") or against torch_memory_saver itself ("theirs",
# the control), unchanged apart from its two test-helper imports, which are served from copies
# of torch_memory_saver's own files under other names.
#
#   tools/tms_examples.sh TMS_TEST_DIR TMS_WHEEL ours|theirs [pytest arguments...]
#
# TMS_TEST_DIR: the test/ folder of a torch_memory_saver checkout; TMS_WHEEL: its wheel (the
# helper files come from it, and "theirs" installs it into a private folder). Neither is part of
# this repository. Needs a GPU to pass; prints pytest's summary line.
set -euo pipefail
test_dir=$(realpath "$1"); wheel=$(realpath "$2"); who=$3; shift 3
python=${PYTHON:-python3}
work=$(mktemp -d /tmp/tms_examples.XXXXXX)
trap 'rm -rf "$work"' EXIT

cp -r "$test_dir/test_examples.py" "$test_dir/examples" "$work/"
"$python" - "$wheel" "$work" <<'EOF'
import sys, zipfile
wheel, work = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for inner, outer in (("torch_memory_saver/testing_utils.py", "tms_testing_utils.py"),
                         ("torch_memory_saver/utils.py", "tms_utils.py")):
        with open(f"{work}/{outer}", "wb") as f:
            f.write(z.read(inner))
EOF
# Redirect only the two helper imports; everything else stays as torch_memory_saver wrote it.
sed -i -e 's/torch_memory_saver\.testing_utils/tms_testing_utils/g' -e 's/torch_memory_saver\.utils/tms_utils/g' \
  "$work"/test_examples.py "$work"/examples/*.py "$work"/tms_testing_utils.py

case $who in
  ours) site=$("$python" -m torch_mem_saver_lite --alias-path) ;;
  theirs) site=$work/site; "$python" -m pip install -q --no-deps --target "$site" "$wheel" ;;
  *) echo "tms_examples.sh: say ours or theirs, not $who" >&2; exit 2 ;;
esac
cd "$work"
PYTHONPATH=$site:$work${PYTHONPATH:+:$PYTHONPATH} "$python" -m pytest -v -p no:cacheprovider --timeout 100 \
  test_examples.py "$@"

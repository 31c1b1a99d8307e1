#!/usr/bin/env bash
# Here, before and after a lent GPU's one call (the `device` tool): the kit bench/gpu_before_after.sh reads there,
# and a checkout light enough to travel.
#
#   bench/gpu_kit.sh [BEFORE]     make .device/ and lighten the checkout (BEFORE: the engine to compare with,
#                                 default 7709dac, the last commit before continuous depth batching, issue 69)
#   device run: command "bash bench/gpu_before_after.sh", carry [".device"], timeout_s 600
#   bench/gpu_kit.sh --restore    put the checkout back as it was (the checkpoints in the index, no .device/)
#
# Why lighten: a call sends the tracked files, the untracked ones git does not ignore and the carried paths, 64 MiB
# in all, and the tracked tree is 63.4 MiB (at 332cc09), 47.5 MiB of it the embedded checkpoints and their training
# snapshots. The GPU bench builds a random Huginn-0125 on the device and reads none of them, so they leave git's
# index for the call (`git rm --cached`: the files stay on disk) and are ignored through .git/info/exclude; the
# restore puts them back in the index from HEAD. What .device/ holds:
#   wheels/      what the device image lacks for exitbench's import path (pydantic and its needs), at the
#                versions this environment runs, for the image's Python (DEVICE_PYTHON, default 3.12)
#   before.tar   exitbench/ at BEFORE without its checkpoints, so one call times both engines with one bench
# Run it with the project's virtual environment active (its pydantic's versions are the ones fetched).
set -euo pipefail
cd "$(dirname "$0")/.."

KIT=.device
LIGHT=exitbench/checkpoints
MARK="# bench/gpu_kit.sh"
EXCLUDE="$(git rev-parse --git-path info/exclude)"
LIMIT=$((64 * 1024 * 1024))
DEVICE_PYTHON="${DEVICE_PYTHON:-3.12}"

restore() {
    git reset -q -- "$LIGHT"
    if [ -f "$EXCLUDE" ]; then  # (the kit's block of patterns: gitignore has no comments after a pattern)
        awk -v mark="$MARK" '$0 == mark " begin" { skip = 1 } !skip { print } $0 == mark " end" { skip = 0 }' \
            "$EXCLUDE" >"$EXCLUDE.new"
        mv "$EXCLUDE.new" "$EXCLUDE"
    fi
    rm -rf "$KIT"
    echo "restored: $LIGHT back in git's index, $KIT/ gone"
}

travelling_bytes() {  # what a call would send: tracked, untracked and not ignored, and the carried kit
    { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null |
        awk -v kit="$(du -sb "$KIT" | cut -f1)" '{ s += $1 } END { print s + kit }'
}

if [ "${1:-}" = "--restore" ]; then
    restore
    exit 0
fi
BEFORE="${1:-7709dac}"
git rev-parse --verify -q "$BEFORE^{commit}" >/dev/null || {
    echo "error: $BEFORE is no commit of this repository; give the revision whose engine to compare with" >&2
    exit 2
}
git diff --quiet -- "$LIGHT" || {
    echo "error: $LIGHT has changes git has not committed; commit or drop them, the restore takes it from HEAD" >&2
    exit 2
}
command -v python >/dev/null || {
    echo "error: no python on PATH; activate the project's virtual environment (its pydantic is what is fetched)" >&2
    exit 2
}
versions="$(python - <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
names = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions")
try:
    print(" ".join(f"{name}=={version(name)}" for name in names))
except PackageNotFoundError as exc:
    print(f"error: {exc.name} is not installed here; activate the project's virtual environment", file=sys.stderr)
    raise SystemExit(2)
EOF
)"

rm -rf "$KIT"
mkdir -p "$KIT/wheels"
# shellcheck disable=SC2086  # one argument per package
python -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$DEVICE_PYTHON" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$KIT/wheels" $versions
git archive --format=tar -o "$KIT/before.tar" "$BEFORE" -- exitbench ":(exclude)$LIGHT"
git rev-parse "$BEFORE" >"$KIT/before.rev"
# (the call times the working tree as it is: an engine change not yet committed is the "after")
changed() {  # tracked files that differ from HEAD (the kit's own index change aside), or new files that travel
    ! git diff --quiet HEAD -- . ":(exclude)$LIGHT" ||
        [ -n "$(git ls-files --others --exclude-standard -- . ":(exclude)$KIT")" ]
}
{ git rev-parse HEAD | tr -d '\n'; if changed; then echo -n " with changes not committed"; fi; echo; } \
    >"$KIT/after.rev"

mkdir -p "$(dirname "$EXCLUDE")"
touch "$EXCLUDE"
grep -qxF "$MARK begin" "$EXCLUDE" || printf '%s\n' "$MARK begin" "/$KIT/" "/$LIGHT/" "$MARK end" >>"$EXCLUDE"
git rm -r -q --cached --ignore-unmatch -- "$LIGHT"  # (a second run finds them out already)

sent="$(travelling_bytes)"
awk -v s="$sent" -v w="$(du -sb "$KIT/wheels" | cut -f1)" -v b="$(git rev-parse --short "$BEFORE")" \
    'BEGIN { printf "a call sends %.1f MiB of 64 (%.1f MiB of wheels; exitbench at %s)\n", s / 2^20, w / 2^20, b }'
if [ "$sent" -gt "$LIMIT" ]; then
    restore
    echo "error: the call would send more than 64 MiB; nothing is changed" >&2
    exit 2
fi
echo 'now: device run, command "bash bench/gpu_before_after.sh", carry [".device"], timeout_s 600;'
echo 'then: bench/gpu_kit.sh --restore (before any commit: until then git sees the checkpoints as deleted)'

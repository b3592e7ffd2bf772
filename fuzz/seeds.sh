#!/usr/bin/env bash
# Writes fuzz seeds from the golden encodings file (GOLDEN, one
# "NAME HEX" line per encoding) into OUT/<target>/: every log entry, in every
# data format, for entry_apply; every snapshot for snapshot_decode; the job
# spec for spec_validate. Derived, not checked in, so the seeds follow every
# new format and command.
set -euo pipefail
golden=$1
out=$2
targets=(entry_apply snapshot_decode spec_validate)
for t in "${targets[@]}"; do
    rm -rf "${out:?}/$t"
    mkdir -p "$out/$t"
done
n=0
while read -r kind rest; do
    hex=${rest##* }
    name=${rest% *}
    case $kind in
        entry-v*) dir=entry_apply; file="$kind-$name" ;;
        snapshot-v*) dir=snapshot_decode; file=$kind ;;
        jobspec) dir=spec_validate; file=$kind ;;
        *) continue ;;
    esac
    # The same command may appear more than once (several policies): number them.
    n=$((n + 1))
    printf '%b' "$(sed 's/../\\x&/g' <<<"$hex")" >"$out/$dir/$file-$n"
done <"$golden"
echo "fuzz seeds: $(ls "$out/entry_apply" | wc -l) entries, $(ls "$out/snapshot_decode" | wc -l) snapshots, $(ls "$out/spec_validate" | wc -l) spec from $golden"

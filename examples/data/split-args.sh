# shellcheck shell=bash disable=SC2034  # split_args is read by the sourcing script
# Sourced by the prepare-*.sh recipes: turns SPLIT / SPLIT_FROM into the extractor's arguments.
#   SPLIT=bundled (default): the held-out units listed in splits/NAME.tsv
#   SPLIT=hash: the extractor's own hash split;   SPLIT=FILE: units listed in FILE
#   SPLIT_FROM=DIR: derive the held-out units from another copy of the data
# usage: split_args_for NAME   (sets the array split_args; needs die() and HERE)
split_args_for() {
    local bundled="$HERE/splits/$1.tsv"
    SPLIT=${SPLIT:-bundled}
    if [ -n "${SPLIT_FROM:-}" ]; then
        [ -d "$SPLIT_FROM" ] || die "SPLIT_FROM is not a directory: $SPLIT_FROM"
        split_args=(--split-from "$SPLIT_FROM")
    elif [ "$SPLIT" = bundled ]; then
        [ -f "$bundled" ] || die "missing $bundled"
        split_args=(--split-ids "$bundled")
    elif [ "$SPLIT" = hash ]; then
        split_args=()
    elif [ -f "$SPLIT" ]; then
        split_args=(--split-ids "$SPLIT")
    else
        die "SPLIT must be 'bundled', 'hash' or a split file (got '$SPLIT')"
    fi
}

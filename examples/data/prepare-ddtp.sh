#!/usr/bin/env bash
# Debian package descriptions, German -> English (DDTP) -> raw segment pairs -> joint BPE -> fairseq binary.
#
# usage: prepare-ddtp.sh [OUT_DIR]          (default: ./data-prep/ddtp-de-en)
#
# Source: the i18n/Translation-en and Translation-de indexes of Debian 12 "bookworm", component main,
# fetched with apt itself (only a Debian mirror is needed).  apt runs with a PRIVATE configuration
# (APT_CONFIG=OUT_DIR/apt/apt.conf: own sources list, lists dir, cache, no system config parts), so the
# system's apt state is neither read nor touched; it works as root and as a normal user.  Only the
# "Translations" index target for languages en and de is downloaded (about 8 MB), no Packages files.
# The archive is verified with /usr/share/keyrings/debian-archive-keyring.gpg (package
# debian-archive-keyring).
#
# Then ddtp_extract.py (standard library only) joins the records on Description-md5, pairs short
# descriptions and paragraphs, filters, splits by Description-md5 (all segments of a description in
# one split) and removes cross-split overlaps, as described in shared/data/ddtp-de-en/README.md.
# Finally bpe-binarize.sh, direction de -> en, joined dictionary.
#
# NOT reproducible: the bundled copy shared/data/ddtp-de-en also dropped 80 train pairs "whose English
# side is reserved for other evaluation sets"; that list is not published, so train here has those
# 80 pairs more (29088 instead of 29008 pairs with the bundled split, archive of July 2026).
#
# Outputs:
#   OUT_DIR/apt/                             private apt state (lists/ holds the downloaded indexes)
#   OUT_DIR/raw/{train,valid,test}.{de,en}   raw text pairs, OUT_DIR/raw/stats.txt
#   OUT_DIR/bpe/, OUT_DIR/bin/               BPE text and fairseq-preprocess output (--joined-dictionary)
# Environment: PYTHON (default python, else python3), BPE_MERGES (default 8000), WORKERS (default 2),
#   DEBIAN_MIRROR (default http://deb.debian.org/debian), DEBIAN_SUITE (default bookworm),
#   DEBIAN_KEYRING (default /usr/share/keyrings/debian-archive-keyring.gpg),
#   TRANSLATION_EN / TRANSLATION_DE: use these index files (plain/.xz/.gz/.bz2/.lz4) instead of apt,
#   SPLIT: which descriptions are held out:
#     bundled (default)  those of the bundled copy (splits/ddtp-de-en.tsv, 413 test + 419 valid
#                        md5s): valid and test are then byte-identical to shared/data/ddtp-de-en and
#                        none of their segments is in train, so results are comparable with it;
#                        descriptions not in the list (archive changes) go to train;
#     hash               sha256(md5) order, ~1000 test then ~1000 valid pairs (README recipe);
#                        its test overlaps the bundled train: do not mix the two;
#     FILE               an "md5<TAB>test|valid" list.
#   SPLIT_FROM=DIR       derive the held-out descriptions from an existing copy DIR/*.{de,en}.
# Re-running skips steps whose outputs exist and are up to date (delete OUT_DIR/apt to re-download).
set -euo pipefail

die() { echo "prepare-ddtp.sh: error: $*" >&2; exit 1; }
log() { echo "[prepare-ddtp $(date +%H:%M:%S)] $*" >&2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${1:-data-prep/ddtp-de-en}
PYTHON=${PYTHON:-$(command -v python || command -v python3 || true)}
BPE_MERGES=${BPE_MERGES:-8000}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${DEBIAN_SUITE:-bookworm}
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
[ -n "$PYTHON" ] || die "no python found (set \$PYTHON)"
[ -f "$HERE/ddtp_extract.py" ] || die "missing $HERE/ddtp_extract.py"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)   # apt needs absolute paths

# 1. the Translation-en / Translation-de indexes
find_index() {  # $1 = language; prints the newest matching file in the private lists dir
    ls -t "$APT/lists/"*"_dists_${SUITE}_main_i18n_Translation-$1"{,.xz,.gz,.bz2,.lz4} 2>/dev/null | head -n 1 || true
}
APT=$OUT/apt
if [ -n "${TRANSLATION_EN:-}" ] || [ -n "${TRANSLATION_DE:-}" ]; then
    EN=${TRANSLATION_EN:?set both TRANSLATION_EN and TRANSLATION_DE}
    DE=${TRANSLATION_DE:?set both TRANSLATION_EN and TRANSLATION_DE}
    log "using given indexes: $EN, $DE"
elif [ -n "$(find_index en)" ] && [ -n "$(find_index de)" ]; then
    EN=$(find_index en) DE=$(find_index de)
    log "exists, skipping download: $EN, $DE"
else
    command -v apt-get >/dev/null || die "apt-get not found; download the indexes yourself and set TRANSLATION_EN/TRANSLATION_DE"
    [ -r "$KEYRING" ] || die "Debian archive keyring not readable: $KEYRING (apt-get install debian-archive-keyring, or set DEBIAN_KEYRING)"
    mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/etc/apt.conf.d" \
             "$APT/etc/sources.list.d" "$APT/etc/preferences.d" "$APT/state" "$APT/log"
    : > "$APT/state/status"
    echo "deb [signed-by=$KEYRING lang=en,de target=Translations] $MIRROR $SUITE main" > "$APT/etc/sources.list"
    # Read first (APT_CONFIG) and pointing all Dir:: settings into $APT, so no system file is used.
    # As root apt would hand downloads to the _apt user, which may not be able to enter OUT_DIR;
    # keep the current user instead (the download is still verified against the keyring).
    cat > "$APT/apt.conf" <<EOF
Dir::Etc::main "/dev/null";
Dir::Etc::parts "$APT/etc/apt.conf.d";
Dir::Etc::sourcelist "$APT/etc/sources.list";
Dir::Etc::sourceparts "$APT/etc/sources.list.d";
Dir::Etc::preferences "/dev/null";
Dir::Etc::preferencesparts "$APT/etc/preferences.d";
Dir::State "$APT/state";
Dir::State::lists "$APT/lists";
Dir::State::status "$APT/state/status";
Dir::Cache "$APT/cache";
Dir::Log "$APT/log";
Acquire::Languages { "en"; "de"; };
APT::Sandbox::User "$(id -un)";
EOF
    log "apt-get update (private state in $APT): $MIRROR $SUITE main, Translation-{en,de}"
    APT_CONFIG=$APT/apt.conf apt-get -q update >&2 || die "apt-get update failed (is $MIRROR reachable?)"
    EN=$(find_index en) DE=$(find_index de)
    [ -n "$EN" ] || die "apt did not fetch Translation-en (look in $APT/lists)"
    [ -n "$DE" ] || die "apt did not fetch Translation-de (look in $APT/lists)"
fi
[ -f "$EN" ] || die "missing input file: $EN"
[ -f "$DE" ] || die "missing input file: $DE"
release=$(ls "$APT/lists/"*"_dists_${SUITE}_InRelease" 2>/dev/null | head -n 1 || true)
if [ -n "$release" ]; then
    log "archive: $(grep -m1 '^Version:' "$release" || true), $(grep -m1 '^Date:' "$release" || true)"
fi

# which units are held out (see the extractor's docstring and split-args.sh)
# shellcheck source=examples/data/split-args.sh
source "$HERE/split-args.sh"
split_args_for ddtp-de-en

# 2. raw segment pairs
RAW=$OUT/raw
EXTRACT_ARGS="${split_args[*]:-hash}"
if [ -s "$RAW/test.en" ] && [ "$RAW/test.en" -nt "$EN" ] && [ "$RAW/test.en" -nt "$DE" ] \
        && [ "$(cat "$RAW/extract-args.txt" 2>/dev/null)" = "$EXTRACT_ARGS" ]; then
    log "exists, skipping extraction: $RAW"
else
    log "extracting segment pairs -> $RAW"
    "$PYTHON" "$HERE/ddtp_extract.py" --en "$EN" --de "$DE" --out "$RAW.tmp" \
        "${split_args[@]}" >&2
    echo "$EXTRACT_ARGS" > "$RAW.tmp/extract-args.txt"
    rm -rf "$RAW"
    mv "$RAW.tmp" "$RAW"
fi
for split in train valid test; do
    echo "$split: $(wc -l < "$RAW/$split.de") pairs"
done

# 3. joint BPE + binarisation, German -> English
bash "$HERE/bpe-binarize.sh" de en "$RAW" "$OUT" "$BPE_MERGES"
log "done: fairseq data in $OUT/bin"

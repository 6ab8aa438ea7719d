#!/usr/bin/env python3
"""Build German-English segment pairs from Debian's description translations (DDTP).

Standard library only.  Input: the ``Translation-en`` and ``Translation-de``
indexes of one Debian release/component (plain text, or compressed as .xz, .gz,
.bz2; .lz4 is read through ``lz4 -dc`` or apt's ``apt-helper cat-file``).
Output: ``OUT/{train,valid,test}.{de,en}`` (raw UTF-8 text, one segment per line,
line n of .de aligned with line n of .en) and ``OUT/stats.txt``.

The procedure is the one described in ``shared/data/ddtp-de-en/README.md``:

1. Parse both files into records (Description-md5, short description, long
   description).  Join the German records (first record per md5) to the English
   ones on Description-md5.
2. One segment pair from the two short descriptions.  Long descriptions are split
   into paragraphs at the " ." lines; if both sides have the same number of
   paragraphs, paragraph i is paired with paragraph i (otherwise only the short
   descriptions of that record are used).  A paragraph's lines are joined with
   single spaces and runs of ASCII whitespace are collapsed (non-breaking and other
   Unicode spaces are kept as they are).  A paragraph holding a list or verbatim line
   (a bullet "* ", "- ", "+ ", "o ", or a line indented by two spaces) is kept only if
   it is a single line; otherwise that paragraph pair is skipped.
3. Drop pairs with an empty side, a side over 80 words, a word-count ratio over 3,
   identical sides (untranslated) and exact duplicate pairs (first one kept).
4. Split by a hash of Description-md5 (all segments of one description land in the
   same split): descriptions are ordered by sha256(md5) and the first ones fill test
   (until >= --test-size pairs), the next ones valid (>= --valid-size pairs), the rest
   is train.  Then valid pairs whose English or German side occurs in test are
   removed, and train pairs whose English or German side occurs in valid or test.

Which descriptions go to test/valid: the hash that chose them for the bundled copy in
shared/data/ddtp-de-en is not published, so there are three ways:
  --split-ids FILE   lines "Description-md5<TAB>test|valid"; unlisted ones go to train.
                     splits/ddtp-de-en.tsv (next to this script) is the bundled copy's
                     choice, so the result has that copy's valid and test, byte for byte.
  --split-from DIR   derive the same from an existing copy DIR/{train,valid,test}.{en,de}.
  (neither)          the sha256 ordering of step 4.
--save-split FILE writes the choice made in that format.

Not reproduced: the bundled copy additionally removed 80 train pairs "whose English
side is reserved for other evaluation sets"; that list is not published, so this
script cannot remove them (train has those 80 pairs more).

Words are whitespace-separated tokens (``str.split()``).
"""

import argparse
import bz2
import collections
import gzip
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import sys

BULLET = re.compile(r"^\s*[*\-+o\u2022]\s")
ASCII_WS = re.compile(r"[ \t\r\n\f\v]+")
MAX_WORDS = 80
MAX_RATIO = 3.0


def die(msg):
    sys.exit("ddtp_extract.py: error: " + msg)


def open_text(path):
    """Open a (possibly compressed) apt index as a text stream."""
    if not os.path.isfile(path):
        die("input file not found: %s" % path)
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".bz2"):
        return bz2.open(path, "rt", encoding="utf-8")
    if path.endswith(".lz4"):
        for cmd in (["lz4", "-dc", path], ["/usr/lib/apt/apt-helper", "cat-file", path]):
            if shutil.which(cmd[0]) or os.path.exists(cmd[0]):
                out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE).stdout
                return iter(out.decode("utf-8").splitlines(True))
        die("cannot read %s: neither lz4 nor apt-helper is available" % path)
    return open(path, encoding="utf-8")


def parse_translation(path, lang):
    """Return {md5: (short, [long lines])}, first record per md5, in file order."""
    records = collections.OrderedDict()
    n_records = 0
    md5 = short = None
    long_lines = []

    def flush():
        if md5 is not None and short is not None and md5 not in records:
            records[md5] = (short, long_lines)

    field = None
    for raw in open_text(path):
        line = raw.rstrip("\n")
        if not line.strip():
            flush()
            md5 = short = None
            long_lines = []
            field = None
            continue
        if line[0] in " \t":
            if field == "desc":
                long_lines.append(line)
            continue
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "Package":
            n_records += 1
            field = None
        elif key == "Description-md5":
            md5 = value
            field = None
        elif key == "Description-" + lang:
            short = value
            field = "desc"
        else:
            field = None
    flush()
    return records, n_records


def norm(text):
    return ASCII_WS.sub(" ", text).strip()


def paragraphs(long_lines):
    paras = [[]]
    for line in long_lines:
        if line.strip() == ".":
            paras.append([])
        else:
            paras[-1].append(line[1:])  # drop the one-space continuation marker
    return [p for p in paras if p]


def is_list_or_verbatim(line):
    return line.startswith(" ") or bool(BULLET.match(line))


def build_pairs(en, de, stats):
    """Yield (md5, en_segment, de_segment) before filtering."""
    for md5, (de_short, de_long) in de.items():
        if md5 not in en:
            stats["translation md5 without English record"] += 1
            continue
        stats["descriptions joined"] += 1
        en_short, en_long = en[md5]
        yield md5, norm(en_short), norm(de_short)
        pe, pd = paragraphs(en_long), paragraphs(de_long)
        if len(pe) != len(pd):
            stats["descriptions with differing paragraph counts (long part skipped)"] += 1
            continue
        for a, b in zip(pe, pd):
            if (len(a) > 1 and any(map(is_list_or_verbatim, a))) or (
                len(b) > 1 and any(map(is_list_or_verbatim, b))
            ):
                stats["multi-line list/verbatim paragraphs skipped"] += 1
                continue
            yield md5, norm(" ".join(a)), norm(" ".join(b))


def filter_pairs(pairs, stats):
    seen = set()
    for md5, e, d in pairs:
        if not e or not d:
            stats["dropped: empty side"] += 1
            continue
        ne, nd = len(e.split()), len(d.split())
        if ne > MAX_WORDS or nd > MAX_WORDS:
            stats["dropped: side over %d words" % MAX_WORDS] += 1
            continue
        if max(ne, nd) > MAX_RATIO * min(ne, nd):
            stats["dropped: word ratio over %g" % MAX_RATIO] += 1
            continue
        if e == d:
            stats["dropped: identical sides (untranslated)"] += 1
            continue
        if (e, d) in seen:
            stats["dropped: exact duplicate pair"] += 1
            continue
        seen.add((e, d))
        yield md5, e, d


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def split_from_reference(pairs, ref_dir, stats):
    """md5 -> split, taken from where an existing copy holds each description's pairs."""
    where = {}
    for split in ("test", "valid", "train"):
        for e, d in zip(read_lines(os.path.join(ref_dir, split + ".en")),
                        read_lines(os.path.join(ref_dir, split + ".de"))):
            where.setdefault((e, d), split)
    assign = {}
    rank = {"test": 0, "valid": 1, "train": 2}
    for md5, e, d in pairs:
        split = where.get((e, d))
        if split is None:
            continue
        if md5 not in assign or rank[split] < rank[assign[md5]]:
            assign[md5] = split
    stats["pairs not found in --split-from copy"] = sum((e, d) not in where for _, e, d in pairs)
    return assign


def read_split_ids(path):
    assign = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            key, _, split = line.rstrip("\n").partition("\t")
            if split not in ("train", "valid", "test"):
                die("%s:%d: expected 'ID<TAB>train|valid|test'" % (path, n))
            assign[key] = split
    return assign


def save_split(path, assign):
    with open(path, "w", encoding="utf-8") as f:
        for key in sorted(k for k, v in assign.items() if v != "train"):
            f.write("%s\t%s\n" % (key, assign[key]))


def split_by_hash(pairs, test_size, valid_size):
    per_md5 = collections.Counter(md5 for md5, _, _ in pairs)
    order = sorted(per_md5, key=lambda m: hashlib.sha256(m.encode("ascii")).hexdigest())
    assign, n_test, n_valid = {}, 0, 0
    for md5 in order:
        if n_test < test_size:
            assign[md5] = "test"
            n_test += per_md5[md5]
        elif n_valid < valid_size:
            assign[md5] = "valid"
            n_valid += per_md5[md5]
        else:
            assign[md5] = "train"
    return assign


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--en", required=True, help="Translation-en file (plain, .xz, .gz, .bz2, .lz4)")
    ap.add_argument("--de", required=True, help="Translation-de file")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--test-size", type=int, default=1000, help="pairs in test (approx.)")
    ap.add_argument("--valid-size", type=int, default=1000, help="pairs in valid (approx.)")
    ap.add_argument("--split-ids", metavar="FILE",
                    help="lines 'Description-md5<TAB>test|valid' choosing the held-out "
                         "descriptions; all others go to train")
    ap.add_argument("--save-split", metavar="FILE", help="write the test/valid choice made here")
    ap.add_argument("--split-from", metavar="DIR",
                    help="reuse the test/valid/train assignment of descriptions found in an "
                         "existing copy (DIR/{train,valid,test}.{en,de}); unknown ones go to train")
    args = ap.parse_args()

    stats = collections.Counter()
    en, n_en = parse_translation(args.en, "en")
    de, n_de = parse_translation(args.de, "de")
    if not en or not de:
        die("no records parsed (en: %d, de: %d); are these Translation files?" % (len(en), len(de)))
    stats["en records"] = n_en
    stats["en descriptions (unique md5)"] = len(en)
    stats["de records"] = n_de
    stats["de descriptions (unique md5)"] = len(de)

    pairs = list(filter_pairs(build_pairs(en, de, stats), stats))
    stats["pairs after filters"] = len(pairs)

    if args.split_ids and args.split_from:
        die("give at most one of --split-ids and --split-from")
    if args.split_ids:
        assign = read_split_ids(args.split_ids)
        present = {md5 for md5, _, _ in pairs}
        stats["held-out descriptions listed in --split-ids but absent here"] = sum(
            m not in present for m, v in assign.items() if v != "train")
    elif args.split_from:
        assign = split_from_reference(pairs, args.split_from, stats)
    else:
        assign = split_by_hash(pairs, args.test_size, args.valid_size)
    if args.save_split:
        save_split(args.save_split, assign)
    splits = {"train": [], "valid": [], "test": []}
    for md5, e, d in pairs:
        splits[assign.get(md5, "train")].append((e, d))

    held_en = {e for e, _ in splits["test"]}
    held_de = {d for _, d in splits["test"]}
    before = len(splits["valid"])
    splits["valid"] = [(e, d) for e, d in splits["valid"] if e not in held_en and d not in held_de]
    stats["valid pairs removed (overlap with test)"] = before - len(splits["valid"])
    held_en |= {e for e, _ in splits["valid"]}
    held_de |= {d for _, d in splits["valid"]}
    before = len(splits["train"])
    splits["train"] = [(e, d) for e, d in splits["train"] if e not in held_en and d not in held_de]
    stats["train pairs removed (overlap with valid/test)"] = before - len(splits["train"])

    os.makedirs(args.out, exist_ok=True)
    lines = []
    for split in ("train", "valid", "test"):
        for lang, col in (("en", 0), ("de", 1)):
            with open(os.path.join(args.out, "%s.%s" % (split, lang)), "w", encoding="utf-8") as f:
                for p in splits[split]:
                    f.write(p[col] + "\n")
        n = len(splits[split])
        mean = lambda col: sum(len(p[col].split()) for p in splits[split]) / max(n, 1)
        lines.append("%-5s pairs %6d  mean words .en %.1f  .de %.1f" % (split, n, mean(0), mean(1)))
    lines += ["%s: %d" % kv for kv in sorted(stats.items())]
    with open(os.path.join(args.out, "stats.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

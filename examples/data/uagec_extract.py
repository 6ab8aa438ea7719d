#!/usr/bin/env python3
"""Extract UA-GEC sentence pairs (source -> annotator-1 correction) with the ua_gec API.

Needs the ``ua-gec`` package from PyPI (``pip install ua-gec``; it ships the corpus).
Output: ``OUT/{train,valid,test}.{src,tgt}`` (raw UTF-8 text, one sentence per line,
line n of .src aligned with line n of .tgt) and ``OUT/stats.txt``.

The procedure is the one described in ``shared/data/ua-gec/README.md``:

1. The "gec-only" annotation layer (grammar, spelling, punctuation; fluency edits not
   applied); per document the sentence-split source (``Document.source_sentences``)
   and the first annotator's sentence-split correction (``target_sentences`` of the
   annotator-1 document), aligned line by line.  A document whose two sides have
   different line counts is skipped (none is, in UA-GEC 2.1.3).
2. Lines are stripped; a pair is dropped if its source or target is empty or holds
   only invisible characters (whitespace, format/control characters, the Braille blank
   U+2800, Hangul fillers).  Text is otherwise unchanged; unchanged pairs are kept.
3. test = the official test split, complete (not deduplicated).  valid = whole
   documents of the official train split chosen by a hash of the document id
   (documents ordered by sha256(doc id), taken until >= --valid-size pairs; documents
   of more than --max-valid-doc pairs are left in train, so that one long document
   cannot make up most of valid);
   train = the other train documents.  Exact duplicate pairs are dropped within train
   and within valid; valid pairs whose source occurs in test are removed, and train
   pairs whose source occurs in valid or test.

Which train documents go to valid: the hash that chose the 40 valid documents of the
bundled copy in shared/data/ua-gec is not published, so there are three ways:
  --split-ids FILE   lines "doc_id<TAB>valid"; unlisted documents go to train.
                     splits/ua-gec.tsv (next to this script) is the bundled copy's choice,
                     so the result equals that copy byte for byte.
  --split-from DIR   derive it from an existing copy (a train document is put in valid if
                     each of its pairs is in DIR/valid.{src,tgt} or has its source in test).
  (neither)          the sha256 ordering of step 3.
--save-split FILE writes the choice made in that format.
"""

import argparse
import collections
import hashlib
import os
import sys
import unicodedata

INVISIBLE_EXTRA = {"\u2800", "\u3164", "\u115f", "\u1160", "\uffa0"}


def die(msg):
    sys.exit("uagec_extract.py: error: " + msg)


def is_blank(text):
    for ch in text:
        if ch.isspace() or ch in INVISIBLE_EXTRA:
            continue
        if unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            continue
        return False
    return True


def load_documents(partition, stats):
    """Return [(doc_id, [(src, tgt), ...])] for annotator 1, in corpus order."""
    import ua_gec

    corpus = ua_gec.Corpus(partition=partition, annotation_layer=ua_gec.AnnotationLayer.GecOnly)
    docs = []
    for doc in corpus:
        if doc.meta.annotator_id != 1:
            continue
        src, tgt = doc.source_sentences, doc.target_sentences
        if len(src) != len(tgt):
            stats["official %s documents skipped (line counts differ)" % partition] += 1
            continue
        pairs = []
        for s, t in zip(src, tgt):
            s, t = s.strip(), t.strip()
            if is_blank(s) or is_blank(t):
                stats["official %s lines dropped (empty or invisible characters only)" % partition] += 1
                continue
            pairs.append((s, t))
        docs.append((doc.doc_id, pairs))
    stats["official %s documents" % partition] = len(docs)
    return docs


def dedup(pairs, stats, name):
    seen, out = set(), []
    for p in pairs:
        if p in seen:
            stats["%s exact duplicate pairs dropped" % name] += 1
            continue
        seen.add(p)
        out.append(p)
    return out


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--valid-size", type=int, default=1000, help="pairs in valid (approx.)")
    ap.add_argument("--max-valid-doc", type=int, default=200,
                    help="documents with more pairs than this are never put in valid")
    ap.add_argument("--split-ids", metavar="FILE",
                    help="lines 'doc_id<TAB>valid' choosing the valid documents")
    ap.add_argument("--save-split", metavar="FILE", help="write the valid documents chosen here")
    ap.add_argument("--split-from", metavar="DIR",
                    help="reuse the valid documents of an existing copy (DIR/valid.{src,tgt})")
    args = ap.parse_args()

    try:
        import ua_gec
    except ImportError:
        die("the ua_gec package is not installed in this Python (pip install ua-gec)")

    stats = collections.Counter()
    test_docs = load_documents("test", stats)
    train_docs = load_documents("train", stats)
    if not test_docs or not train_docs:
        die("ua_gec returned no documents")

    if args.split_ids and args.split_from:
        die("give at most one of --split-ids and --split-from")
    if args.split_ids:
        valid_ids = set()
        with open(args.split_ids, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip() or line.startswith("#"):
                    continue
                doc_id, _, split = line.rstrip("\n").partition("\t")
                if split not in ("train", "valid"):
                    die("%s:%d: expected 'doc_id<TAB>valid'" % (args.split_ids, n))
                if split == "valid":
                    valid_ids.add(doc_id)
        known = {i for i, _ in train_docs}
        if valid_ids - known:
            die("--split-ids names documents that are not in the official train split: %s"
                % " ".join(sorted(valid_ids - known)[:10]))
    elif args.split_from:
        ref = set(zip(read_lines(os.path.join(args.split_from, "valid.src")),
                      read_lines(os.path.join(args.split_from, "valid.tgt"))))
        test_src = {s for _, pairs in test_docs for s, _ in pairs}
        valid_ids = {i for i, pairs in train_docs
                     if pairs and all(p in ref or p[0] in test_src for p in pairs)}
    else:
        order = sorted(train_docs, key=lambda d: hashlib.sha256(d[0].encode("utf-8")).hexdigest())
        valid_ids, n = set(), 0
        for doc_id, pairs in order:
            if n >= args.valid_size:
                break
            if len(pairs) > args.max_valid_doc:
                continue
            valid_ids.add(doc_id)
            n += len(pairs)
    if args.save_split:
        with open(args.save_split, "w", encoding="utf-8") as f:
            f.writelines("%s\tvalid\n" % i for i in sorted(valid_ids))
    stats["valid documents"] = len(valid_ids)
    stats["train documents"] = len(train_docs) - len(valid_ids)

    test = [p for _, pairs in test_docs for p in pairs]
    valid = dedup([p for i, pairs in train_docs if i in valid_ids for p in pairs], stats, "valid")
    train = dedup([p for i, pairs in train_docs if i not in valid_ids for p in pairs], stats, "train")

    test_src = {s for s, _ in test}
    before = len(valid)
    valid = [p for p in valid if p[0] not in test_src]
    stats["valid pairs removed (overlap with test)"] = before - len(valid)
    held = test_src | {s for s, _ in valid}
    before = len(train)
    train = [p for p in train if p[0] not in held]
    stats["train pairs removed (overlap with valid/test)"] = before - len(train)
    stats["test repeated pairs (kept)"] = len(test) - len(set(test))

    os.makedirs(args.out, exist_ok=True)
    lines = ["ua_gec %s" % getattr(ua_gec, "__version__", "?")]
    for name, split in (("train", train), ("valid", valid), ("test", test)):
        for side, col in (("src", 0), ("tgt", 1)):
            with open(os.path.join(args.out, "%s.%s" % (name, side)), "w", encoding="utf-8") as f:
                for p in split:
                    f.write(p[col] + "\n")
        n = len(split)
        mean = lambda col: sum(len(p[col].split()) for p in split) / max(n, 1)
        lines.append("%-5s pairs %6d  mean words .src %.1f  .tgt %.1f" % (name, n, mean(0), mean(1)))
    lines += ["%s: %d" % kv for kv in sorted(stats.items())]
    everything = train + valid + test
    lines.append("unchanged pairs (correct sentences), all splits: %.1f%%"
                 % (100.0 * sum(s == t for s, t in everything) / len(everything)))
    with open(os.path.join(args.out, "stats.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

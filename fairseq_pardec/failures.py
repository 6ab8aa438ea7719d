"""fairseq's own failures on bad files and data, as one-line messages of ours (see errors.py).

fairseq raises these from its own code (its checkpoint reader, its translation task, its batching),
so the plugin cannot check first. Each message names the file or flag at fault and what is there
instead. No fairseq import here: errors.py imports this module before fairseq is loaded.
"""

import os
import re
import struct
import sys

from fairseq_pardec.argv import values


def flag_of(path, default="checkpoint"):
    """The command-line flag that gave ``path`` (``--path``, ``--drafter-path``, ...).

    Read from ``sys.argv`` because fairseq's exceptions do not say which flag a file came from;
    ``--path`` may list an ensemble (``a.pt:b.pt``).
    """
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("--") and path in value.split(":"):
            return flag
        if i and argv[i - 1].startswith("--") and path in arg.split(":"):
            return argv[i - 1]
    return default


def raised_in(error, module, function):
    """The frame of ``module.function`` that ``error`` went through, or None."""
    traceback = getattr(error, "__traceback__", None)
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return frame
        traceback = traceback.tb_next
    return None


def _names(folder, keep=lambda name: True):
    try:
        return sorted(n for n in os.listdir(folder) if keep(n))
    except OSError:
        return []


def _shown(names):
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"


# ---------------------------------------------------------------- checkpoint files
def bad_checkpoint(error):
    """Any exception that fairseq's checkpoint reader raises means the file is not a checkpoint.

    The reader is ``load_checkpoint_to_cpu``: ``torch.load`` then fairseq's upgrade of the state.
    torch's own text is never repeated: for a file it cannot unpickle, it advises
    ``weights_only=False``, which would let a file of unknown origin run code.
    """
    if not isinstance(error, Exception) or isinstance(error, MemoryError):
        return None
    frame = raised_in(error, "fairseq.checkpoint_utils", "load_checkpoint_to_cpu")
    path = frame.f_locals.get("path") if frame is not None else None
    if not isinstance(path, str):
        return None
    what = "%s %s" % (flag_of(path), path)
    if os.path.isdir(path):
        return ("%s is a directory, not a checkpoint file; give one of its files (it holds: %s)"
                % (what, _shown(_names(path, lambda n: n.endswith(".pt")))))
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        return ("%s is empty (0 bytes): the checkpoint was not written completely; copy it "
                "again, or train again" % what)
    if "state" in frame.f_locals:  # torch.load returned: a torch file, but not fairseq's
        return ("%s is a torch file but not a fairseq checkpoint (no model and training config "
                "as fairseq-train saves them); give a checkpoint that fairseq-train wrote"
                % what)
    return ("%s: a checkpoint is truncated or not a torch checkpoint (torch cannot read it: %s); "
            "check the file, or train/copy it again" % (what, type(error).__name__))


# A checkpoint's embeddings and output projection have one row per dictionary type.
_SIZE_MISMATCH = re.compile(
    r"size mismatch for (encoder|decoder)\.(embed_tokens|output_projection)\.weight: copying a "
    r"param with shape torch\.Size\(\[(\d+), \d+\]\) from checkpoint, the shape in current "
    r"model is torch\.Size\(\[(\d+), \d+\]\)")


def dictionary_sizes(error):
    """"its source dictionary has N types, this data's has M; ..." where ``error`` is torch's
    refusal to load a checkpoint into a model built with dictionaries of other sizes, or None."""
    if not isinstance(error, RuntimeError):
        return None
    sides = {}
    for part, _, trained, here in _SIZE_MISMATCH.findall(str(error)):
        sides.setdefault("source" if part == "encoder" else "target", (int(trained), int(here)))
    return "; ".join("its %s dictionary has %d types, this data's has %d" % (side, *sizes)
                     for side, sizes in sorted(sides.items())) or None


def other_dictionaries(which, sizes, data="this data's"):
    return ("%s was trained with other dictionaries than %s (%s): decode data binarized with "
            "the checkpoint's dictionaries (fairseq-preprocess --srcdict/--tgtdict with the "
            "dict.*.txt of its training data)" % (which, data, sizes))


def dictionary_mismatch(error):
    """A checkpoint loaded with dictionaries of other sizes than it was trained with."""
    sizes = dictionary_sizes(error)
    if sizes is None:
        return None
    frame = raised_in(error, "fairseq.checkpoint_utils", "load_model_ensemble_and_task")
    path = frame.f_locals.get("filename") if frame is not None else None
    which = "%s %s" % (flag_of(path), path) if isinstance(path, str) else "the checkpoint"
    return other_dictionaries(which, sizes)


# ---------------------------------------------------------------- data directories
MISSING_DICTIONARY = r"No such file or directory: '(.*dict\.([^/']*)\.txt)'"


def missing_dictionary(match, error=None):
    path, language = match.group(1), match.group(2)
    folder = os.path.dirname(path) or "."
    have = [n[len("dict."):-len(".txt")]
            for n in _names(folder, lambda n: n.startswith("dict.") and n.endswith(".txt"))]
    if not have:
        return ("data directory %s has no dictionaries (no dict.%s.txt, no dict.*.txt at all): "
                "give the directory that fairseq-preprocess wrote (its --destdir)"
                % (folder, language))
    return ("-s/-t: data directory %s has no dict.%s.txt (language %r); its languages are %s: "
            "give -s/-t among them" % (folder, language, language, ", ".join(have)))


MISSING_SPLIT = r"Dataset not found: (\S+) \((.*)\)$"


def missing_split(match, error=None):
    split, folder = match.group(1), match.group(2)
    flag = "%s %s" % (flag_of(split, "--gen-subset"), split)
    names = set(_names(folder))
    # fairseq-preprocess writes each file as a pair, SPLIT.SRC-TGT.LANG.bin and .idx: fairseq
    # reports a split with half a pair as missing altogether
    for name in sorted(names):
        stem, ext = os.path.splitext(name)
        if name.startswith(split + ".") and ext in (".bin", ".idx"):
            other = stem + (".idx" if ext == ".bin" else ".bin")
            if other not in names:
                return ("%s: data directory %s has %s but not %s (fairseq-preprocess writes "
                        "both): copy the missing file, or binarize the split again"
                        % (flag, folder, name, other))
    stems = {os.path.splitext(n)[0] for n in names}
    splits = sorted({s.split(".")[0] for s in stems
                     if s + ".bin" in names and s + ".idx" in names})
    return ("%s: data directory %s has no such split (no %s.*.bin); it has: %s"
            % (flag, folder, split, _shown(splits)))


# the reader's functions that take the file's path (its writers, fairseq-preprocess's, do not count)
_READERS = ("__init__", "_do_init", "read_index", "read_data", "infer_dataset_impl")


def _indexed_sentences(index):
    """The number of sentences an ``.idx`` of fairseq's memory-mapped format says it indexes,
    or None where it is not such a file (its header: magic, version, dtype code, count)."""
    try:
        with open(index, "rb") as f:
            header = f.read(26)
    except OSError:
        return None
    if len(header) < 26 or header[:9] != b"MMIDIDX\x00\x00":
        return None
    return struct.unpack_from("<Q", header, 18)[0]


def bad_binarized_file(error):
    """fairseq's reader of a binarized split failed on its files: an ``.idx`` that is not
    fairseq's (random bytes, another format) or cut short; or a split that fairseq-preprocess
    binarized from an empty file (an index of no sentences, an empty ``.bin`` that numpy
    cannot map)."""
    if not isinstance(error, Exception) or isinstance(error, MemoryError):
        return None
    path, reader, traceback = None, None, getattr(error, "__traceback__", None)
    while traceback is not None:  # the deepest frame of the reader that names its file
        frame = traceback.tb_frame
        if (frame.f_globals.get("__name__") == "fairseq.data.indexed_dataset"
                and frame.f_code.co_name in _READERS and "path" in frame.f_locals):
            path, reader = frame.f_locals["path"], frame.f_code.co_name
        traceback = traceback.tb_next
    if not isinstance(path, str):
        return None
    prefix = path[:-4] if path.endswith((".idx", ".bin")) else path
    if (os.path.isfile(prefix + ".bin") and os.path.getsize(prefix + ".bin") == 0
            and _indexed_sentences(prefix + ".idx") == 0):
        split = os.path.basename(prefix).split(".")[0]
        flag = flag_of(split, None)  # --gen-subset, --valid-subset, where typed
        return ("split %s has no sentences: %s.idx indexes none and %s.bin is empty "
                "(fairseq-preprocess was given an empty file); binarize text that has "
                "sentences, or give another split%s"
                % (split, prefix, prefix, " than %s %s" % (flag, split) if flag else ""))
    name = prefix + (".bin" if reader == "read_data" else ".idx")
    said = str(error).split(". ")[0].split("\n")[0] or type(error).__name__
    return ("%s is not a file of a binarized split that fairseq can read, or it is cut short "
            "(%s): copy the split's files again, or binarize it again with fairseq-preprocess "
            "(and the same --dataset-impl)" % (name, said))


# A .bin file shorter than its .idx says, met when a DataLoader worker reads a sentence (the
# worker's traceback is text by then); --task translation_pardec checks it at load time instead
TRUNCATED_BIN = r"offset must be non-negative and no greater than buffer length"


def truncated_bin(match, error=None):
    return ("a binarized .bin file of the data is shorter than its .idx says (truncated): "
            "copy the data directory again, or binarize it again with fairseq-preprocess "
            "(--task translation_pardec names the file)")


def no_space(error):
    """A full disk or quota, met while writing anything (a checkpoint, a log)."""
    import errno

    if not isinstance(error, OSError) or error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = " writing %s" % error.filename if error.filename else ""
    return ("%s%s: free some space, or write to another disk (--save-dir, --results-path, "
            "--out-dir)" % (error.strerror or "no space left on device", where))


NO_LANGUAGE_PAIR = r"Could not infer language pair"


def no_language_pair(match, error=None):
    return ("-s/-t: the data directory has no binarized files (SPLIT.SRC-TGT.LANG.bin) to infer "
            "the languages from; give the directory that fairseq-preprocess wrote, or -s SRC "
            "-t TGT")


# the --generator names that decode at beam 1 only; decoding/registry.py names them when
# imported (the generators live above this module)
GREEDY_ONLY_GENERATORS = set()


def sampling_beam(match, error=None):
    """fairseq-generate's refusal of ``--sampling`` with a beam above ``--nbest``, raised before
    any generator is built. A greedy-only ``--generator`` typed without ``--beam`` takes beam 1
    (tasks/translation_pardec.py): there the typed ``--beam N`` is what to remove."""
    generators, beams = values(sys.argv, "--generator"), values(sys.argv, "--beam")
    name = generators[-1][1] if generators else None
    if name in GREEDY_ONLY_GENERATORS and beams:
        return ("--sampling with --generator %s draws one sample per sentence (beam 1): remove "
                "--beam %s (fairseq requires --nbest = --beam with --sampling)"
                % (name, beams[-1][1]))
    return ("--sampling draws one sample per sentence: add --beam 1 (fairseq requires --nbest = "
            "--beam with --sampling)")


# numpy 2 prints the sizes as ``np.int64(5001)``, numpy 1 as ``5001``
_SIZE = r"(?:np\.\w+\()?(\d+)\)?"
TOO_LONG = (r"Size of sample #(\d+) is invalid \(=\(%s, %s\)\) since "
            r"max_positions=\((\d+), (\d+)\)" % (_SIZE, _SIZE))


def _interactive_buffer_start(error):
    """The input line (from 0) that fairseq-interactive's buffer began with where ``error`` was
    raised, or None. fairseq numbers the sentences of each buffer from 0: without it, a long
    second line was "sentence #0"."""
    traceback = getattr(error, "__traceback__", None)
    while traceback is not None:
        frame = traceback.tb_frame
        code = frame.f_code  # run as fairseq-interactive or as python -m (module __main__)
        if (code.co_name == "main" and code.co_filename.replace(os.sep, "/").endswith(
                "fairseq_cli/interactive.py") and isinstance(frame.f_locals.get("start_id"), int)):
            return frame.f_locals["start_id"]
        traceback = traceback.tb_next
    return None


def interactive_input_name(argv=None):
    """fairseq-interactive's input as a line names it: ``--input FILE`` or standard input."""
    argv = sys.argv if argv is None else argv
    source = "-"
    for i, arg in enumerate(argv):
        if arg.startswith("--input="):
            source = arg.split("=", 1)[1]
        elif arg == "--input" and i + 1 < len(argv):
            source = argv[i + 1]
    return "standard input" if source == "-" else "--input %s" % source


def _frame_in(error, path_end, function):
    """The frame of ``function`` in the file ending with ``path_end`` that ``error`` went
    through, or None (by file: fairseq's CLIs run as ``python -m`` are module ``__main__``)."""
    traceback = getattr(error, "__traceback__", None)
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if code.co_name == function and code.co_filename.replace(os.sep, "/").endswith(path_end):
            return traceback.tb_frame
        traceback = traceback.tb_next
    return None


def first_undecodable(path):
    """(byte offset, line number) of the first byte of ``path`` that is not UTF-8, or None.
    Read a line at a time: a newline byte is never part of a multi-byte UTF-8 character."""
    offset = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return offset + error.start, number
            offset += len(line)
    return None


def interactive_input_not_utf8(error):
    """fairseq-interactive reads its input as UTF-8 (``buffered_read``): a file in another
    encoding ended in ``UnicodeDecodeError``, whose offset is within a block, not the file."""
    if not isinstance(error, UnicodeDecodeError):
        return None
    frame = _frame_in(error, "fairseq_cli/interactive.py", "buffered_read")
    if frame is None:
        return None
    source = frame.f_locals.get("input")
    fix = "convert it to UTF-8 (iconv -f ENCODING -t UTF-8), one sentence per line"
    if not isinstance(source, str) or source == "-":
        return "standard input is not UTF-8 text (%s): %s" % (error.reason, fix)
    try:
        found = first_undecodable(source)
    except OSError:
        found = None
    where = " (byte %d, on line %d, cannot be decoded)" % found if found else ""
    return "--input %s is not UTF-8 text%s: %s" % (source, where, fix)


def too_long(match, error=None):
    index, source, target, max_source, max_target = match.groups()
    if int(source) > int(max_source):
        start = _interactive_buffer_start(error)
        if start is not None:
            # fairseq's own translation task cuts binarized splits only, not interactive input;
            # ours cuts them (--truncate-source) or skips them one by one with a warning
            ours = ("cut such lines with --truncate-source" if "translation_pardec" in sys.argv
                    else "add --task translation_pardec, which skips such lines with a warning "
                    "and decodes the rest (or cuts them with --truncate-source)")
            return ("%s line %d has %s source tokens (EOS included), more than the %s the "
                    "model takes (--max-source-positions): %s, or skip them with "
                    "--skip-invalid-size-inputs-valid-test"
                    % (interactive_input_name(), start + int(index) + 1, source, max_source,
                       ours))
        return ("sentence #%s has %s source tokens (EOS included), more than the %s the model "
                "takes (--max-source-positions): cut long sources with --truncate-source, or "
                "skip them with --skip-invalid-size-inputs-valid-test"
                % (index, source, max_source))
    return ("sentence #%s has a reference of %s tokens, more than --max-target-positions %s: "
            "skip such sentences with --skip-invalid-size-inputs-valid-test"
            % (index, target, max_target))

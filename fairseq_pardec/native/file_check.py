"""The native library as a file: put in place with its checksum beside it, and checked before
it is loaded.

``dlopen`` maps the file's segments where its headers say they are; a file cut short (a copy or
a build that died, a full disk) has headers pointing past its end, and touching those pages
kills the process with SIGBUS, with no exception to catch. So a library is loaded only when its
ELF headers and segments lie within the file and its SHA-256 equals the one written beside it
(``<library>.sha256``, in ``sha256sum``'s format) when it was put in place. Both are written to
temporary files and renamed into place, the library first and its checksum last: a process that
dies in between leaves a library whose checksum is missing or another's, which is refused, never
one that passes. Standard library only: setup.py loads this file by path.
"""

import hashlib
import os
import secrets
import struct
from pathlib import Path
from typing import Optional

CHECKSUM_SUFFIX = ".sha256"

ELF_MAGIC = b"\x7fELF"
ET_DYN = 3  # a shared object
# (header size, layout after e_ident, program header size, its layout) per ELF class
_ELF_CLASSES = {1: (52, "HHIIIIIHHHHHH", 32, "IIIIIIII"),
                2: (64, "HHIQQQIHHHHHH", 56, "IIQQQQQQ")}
# where p_offset and p_filesz sit in a program header, per ELF class
_SEGMENT_FIELDS = {1: (1, 4), 2: (2, 5)}


def checksum_path(library: Path) -> Path:
    return library.with_name(library.name + CHECKSUM_SUFFIX)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_new(directory: Path, name: str, data: bytes, mode: int) -> Path:
    """``data`` in a new temporary file of ``directory`` (``mode`` less the umask, as any file
    created there: a library in a shared install or cache is read by other users), on disk
    (fsync: a rename must never publish a file whose blocks a crash could still lose)."""
    temporary = directory / (".tmp-%s-%s" % (name, secrets.token_hex(8)))
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        temporary.unlink()
        raise
    return temporary


def install(built: Path, destination: Path):
    """Put the library ``built`` at ``destination`` with its checksum beside it, each renamed
    into place whole (a process that has the previous library mapped keeps its copy)."""
    data = built.read_bytes()
    checksum = "%s  %s\n" % (_digest(data), destination.name)
    directory = destination.parent
    library = _write_new(directory, destination.name, data, 0o755)
    try:
        written = _write_new(directory, destination.name + CHECKSUM_SUFFIX, checksum.encode(),
                             0o644)
    except BaseException:
        os.unlink(library)
        raise
    os.replace(library, destination)
    os.replace(written, checksum_path(destination))


def remove(library: Path):
    """Delete a library and its checksum (either may be gone already)."""
    for path in (library, checksum_path(library)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _elf_problem(data: bytes) -> Optional[str]:
    """What makes ``data`` unsafe to hand to dlopen as a shared library: not ELF, not a shared
    object, or headers and segments reaching past its end (a file cut short). None if sound."""
    if len(data) < 16 or data[:4] != ELF_MAGIC:
        return "not an ELF file (it starts with %r)" % data[:4]
    layout = _ELF_CLASSES.get(data[4])
    byte_order = {1: "<", 2: ">"}.get(data[5])
    if layout is None or byte_order is None:
        return "an ELF header of an unknown class or byte order"
    header_size, header_format, segment_size, segment_format = layout
    if len(data) < header_size:
        return "truncated: %d bytes, shorter than its ELF header" % len(data)
    (kind, _, _, _, segments_at, sections_at, _, _, segment_entry, segment_count,
     section_entry, section_count, _) = struct.unpack_from(byte_order + header_format, data, 16)
    if kind != ET_DYN:
        return "an ELF file, but not a shared library (type %d)" % kind
    if segment_count and segment_entry != segment_size:
        return "malformed: program headers of %d bytes, not %d" % (segment_entry, segment_size)
    end = max(segments_at + segment_entry * segment_count,
              sections_at + section_entry * section_count if section_count else 0)
    if segments_at + segment_entry * segment_count <= len(data):
        offset_field, size_field = _SEGMENT_FIELDS[data[4]]
        for index in range(segment_count):
            fields = struct.unpack_from(byte_order + segment_format, data,
                                        segments_at + index * segment_entry)
            end = max(end, fields[offset_field] + fields[size_field])
    if end > len(data):
        return "truncated: %d bytes, its ELF headers reach byte %d" % (len(data), end)
    return None


def problem(library: Path) -> Optional[str]:
    """Why ``library`` must not be loaded (cut short, not a shared library, no checksum beside
    it, or another file's checksum), or None where it is safe to load."""
    try:
        data = library.read_bytes()
    except OSError as error:
        return "unreadable (%s)" % (error.strerror or error)
    damaged = _elf_problem(data)
    if damaged:
        return damaged
    beside = checksum_path(library)
    try:
        recorded = beside.read_text().split()
    except FileNotFoundError:
        return "no checksum beside it (%s)" % beside.name
    except (OSError, UnicodeDecodeError) as error:
        return "its checksum %s is unreadable (%s)" % (beside.name, error)
    if not recorded or recorded[0].lower() != _digest(data):
        return "its contents do not match its checksum %s" % beside.name
    return None

"""A Hugging Face checkpoint directory's files, for :mod:`jaxpar.models.hf`: tensors read lazily from inside the
directory only (every path, links resolved, stays in it; stored dtypes checked), and the directory written
whole (beside it, then swapped in by two renames), with the leftovers of a killed writer recovered.

A checkpoint directory is one artefact: a name its index or a link leads outside it is refused. One layout
is inside by construction: the Hugging Face hub cache's ``<repo>/snapshots/<revision>/`` directory, whose files
are links into ``<repo>/blobs/``.

A writer's temporary directories are named ``.<name>.jaxpar-tmp-<owner>-<random>`` (the new checkpoint being
written) and ``.<name>.jaxpar-old-<owner>-<random>`` (the previous one, between the two renames), where
``<owner>`` is ``<host>-<pid>-<start>``: a hash of the host name, the writer's process id and its start time
(Linux ``/proc``; 0 elsewhere), so that a later process can tell whether the writer still runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from typing import Any

import numpy as np

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# stored dtypes (safetensors' names) read as they are, converted on read; integers, booleans, float64 and float8
# (whose scales live in other tensors) are refused
FLOAT_DTYPES = ("F32", "F16", "BF16")


def _safetensors():
    try:
        import safetensors  # noqa: F401
        from safetensors import safe_open
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError("jaxpar.models.hf needs safetensors: pip install 'jaxpar[hf]' (or pip install safetensors)"
                          ) from e
    return safe_open


# ------------------------------------------------------------------------------------------ inside the directory

def _roots(directory: str) -> list[str]:
    """The real directories ``directory``'s files may resolve into: itself, and a hub cache repo's ``blobs``."""
    real = os.path.realpath(directory)
    roots = [real]
    up = os.path.dirname(real)
    if os.path.basename(up) == "snapshots" and os.path.isdir(os.path.join(os.path.dirname(up), "blobs")):
        roots.append(os.path.join(os.path.dirname(up), "blobs"))
    return roots


def inside(directory: str, name: Any, what: str) -> str:
    """``os.path.join(directory, name)``, checked to stay inside ``directory`` once every link is resolved.

    Raises:
      ValueError: ``name`` is not a relative path string, or it (or a link on its way) leads out of ``directory``;
        ``what`` says where the name came from.
    """
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ValueError(f"{what} names {name!r}; a checkpoint's files are named by paths relative to its "
                         f"directory {directory!r}")
    full = os.path.join(directory, name)
    real = os.path.realpath(full)
    if not any(os.path.commonpath([real, root]) == root for root in _roots(directory)):
        raise ValueError(f"{what} names {name!r}, which leads out of the checkpoint directory {directory!r} (to "
                         f"{real!r}); a checkpoint directory is one artefact: put the file inside it (a copy, "
                         "not a link out) and name it relative to it")
    return full


class Reader:
    """Lazy reads of named tensors across a checkpoint's safetensors files (all of them inside its directory)."""

    def __init__(self, path: str):
        safe_open = _safetensors()
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            inside(path, INDEX, "the checkpoint")
            try:
                with open(index) as f:
                    files = json.load(f)["weight_map"]
                if not isinstance(files, dict):
                    raise TypeError(f"'weight_map' is a {type(files).__name__}")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index!r} is not a safetensors index with a 'weight_map' object ({e!r}); "
                                 "restore it, or remove it next to a single model.safetensors") from None
            checked = set()
            for file in files.values():   # before any is opened: a name leading out is never followed
                if not (isinstance(file, str) and file in checked):
                    inside(path, file, f"the index {index!r}")
                    checked.add(file)
        elif os.path.isfile(os.path.join(path, SINGLE)):
            files = None
        else:
            raise ValueError(f"{path!r} has neither {SINGLE} nor {INDEX}; jaxpar reads safetensors checkpoints "
                             "(save_pretrained(..., safe_serialization=True))")
        self.path, self._open, self._handles = path, safe_open, {}
        if files is None:
            files = {k: SINGLE for k in self._file(SINGLE).keys()}
        self.files = files

    def _file(self, file: str):
        if file not in self._handles:
            full = inside(self.path, file, "the checkpoint")
            if not os.path.isfile(full):
                raise ValueError(f"the checkpoint's index names {file!r}, which is not in {self.path!r}")
            try:
                self._handles[file] = self._open(full, framework="numpy")
            except Exception as e:   # safetensors raises its own SafetensorError for a torn or foreign file
                raise ValueError(f"{full!r} is not a readable safetensors file ({e}); it may be truncated: "
                                 "copy the checkpoint again") from None
        return self._handles[file]

    def _handle(self, name: str):
        if name not in self.files:
            raise ValueError(f"the checkpoint in {self.path!r} has no tensor {name!r}")
        handle = self._file(self.files[name])
        if name not in handle.keys():
            raise ValueError(f"the index of {self.path!r} puts tensor {name!r} in {self.files[name]!r}, which does "
                             "not hold it: the index and the shards disagree")
        return handle

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def check_dtype(self, name: str) -> None:
        """Raises a ValueError naming tensor ``name`` when its stored dtype is not in :data:`FLOAT_DTYPES`."""
        stored = self._handle(name).get_slice(name).get_dtype()
        if stored not in FLOAT_DTYPES:
            raise ValueError(f"tensor {name!r} in {os.path.join(self.path, self.files[name])!r} is stored as "
                             f"{stored}; jaxpar.models.hf reads weights stored as float32, float16 or bfloat16 "
                             "(a quantized or integer checkpoint: dequantize it and save it again)")

    def read(self, name: str, rows: slice, cols: slice | None = None, *inner: slice) -> np.ndarray:
        """``tensor[rows, cols, *inner]`` (1-D tensors: ``tensor[rows]``) read from disk; float32."""
        sl = self._handle(name).get_slice(name)
        out = sl[rows] if cols is None else sl[(rows, cols, *inner)]
        return np.asarray(out, np.float32)


# ------------------------------------------------------------------------------------------ whole or not at all

def _host() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _start_time(pid: int) -> int:
    """Process ``pid``'s start time (clock ticks after boot, ``/proc/<pid>/stat`` field 22); 0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def owner(pid: int | None = None) -> str:
    """``<host>-<pid>-<start>`` of process ``pid`` (default: this one), the part of a temporary name that
    identifies its writer."""
    pid = os.getpid() if pid is None else pid
    return f"{_host()}-{pid}-{_start_time(pid)}"


def _runs(host: str, pid: int, start: int) -> bool:
    """Whether the writer may still run: True for another host's (its processes cannot be seen from here), this
    process, or a process ``pid`` that exists with the recorded start time (a pid reused since is another one)."""
    if host != _host() or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):   # no such process (a pid beyond any: none either)
        return False
    except PermissionError:   # another user's process
        pass
    now = _start_time(pid)
    return not (start and now and now != start)


def temp_dir(directory: str, kind: str) -> str:
    """A new empty ``.<name>.jaxpar-<kind>-<owner>-<random>`` directory beside ``directory`` (kind ``tmp``)."""
    parent, base = os.path.split(os.path.abspath(directory))
    return tempfile.mkdtemp(prefix=f".{base}.jaxpar-{kind}-{owner()}-", dir=parent)


def recover(directory: str) -> None:
    """Finishes what a killed :func:`swap_in` into ``directory`` left, for writers that no longer run: an old
    checkpoint renamed aside with no ``directory`` is renamed back (the new one was not swapped in: the save did
    not happen); an old one beside a ``directory`` is removed (the swap was done), as is every temporary
    directory. A running writer's directories are never touched."""
    parent, base = os.path.split(os.path.abspath(directory))
    try:
        names = os.listdir(parent)
    except OSError:   # no parent, or one this process may not list: nothing it could recover
        return
    pattern = re.compile(rf"\.{re.escape(base)}\.jaxpar-(old|tmp)-([0-9a-f]{{8}})-(\d+)-(\d+)-[a-z0-9_]+")
    matches = (pattern.fullmatch(name) for name in names)
    dead = sorted((m.group(1), m.group(0)) for m in matches
                  if m and not _runs(m.group(2), int(m.group(3)), int(m.group(4))))
    for kind, name in dead:   # "old" before "tmp"
        path = os.path.join(parent, name)
        try:
            if kind == "old" and not os.path.lexists(directory):
                os.rename(path, directory)
            else:
                shutil.rmtree(path)
        except OSError:   # recovered by another process first, or a read-only file system: left as it is
            pass


def swap_in(new: str, directory: str) -> None:
    """Moves directory ``new`` to ``directory``, replacing an existing ``directory`` (renamed aside first, then
    removed); :func:`recover` finishes or undoes it after a kill."""
    if not os.path.isdir(directory):
        os.rename(new, directory)
        return
    old = temp_dir(directory, "old")
    os.rmdir(old)
    os.rename(directory, old)
    os.rename(new, directory)
    shutil.rmtree(old, ignore_errors=True)


def write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)

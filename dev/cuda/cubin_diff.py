#!/usr/bin/env python3
"""Did a change to a .cu file move code without changing it? Compares the machine code of
every kernel of two cubins (their .text.<kernel> sections, byte for byte).

  dev/cuda/cubin_diff.py BEFORE.cubin[,MORE.cubin...] AFTER.cubin[,MORE.cubin...] [--rename OLD=NEW ...] [--fields]

A side may pool several cubins (a file split in two, or two files merged): their kernels are
compared as one set, and a kernel that several of them hold (a header's kernel compiled into
each) must be the same in all. nvcc prefixes the names in an anonymous namespace with a hash of
the file (`_INTERNAL_<hash>_<n>_<file>_cu_<hash>::`); that prefix is dropped, so a kernel that
moved to another file keeps its name.

Cubins: compile the file before and after with the build's nvcc command plus
`-keep -keep-dir DIR` (DIR/<file>.compute_90a.cubin, .compute_90.cubin). Prints per kernel
(demangled) `identical`, `DIFFERENT`, or that it exists on one side only; exit 1 if any
differs. --rename maps a substring of BEFORE's names onto AFTER's (a dropped template
argument: 'fwd_kernel<false, =fwd_kernel<'). --fields says, for kernels that differ only in
the 16-bit field at bits 40-55 of their instructions (the constant-bank offset: kernel
parameters that moved), how many instructions differ and by how much that field moved.
Needs no CUDA tools beyond nvcc (no cuobjdump): identical bytes are identical SASS.
"""
import re
import struct
import subprocess
import sys
from collections import Counter


def sections(path):
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        sys.exit(f"{path}: not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]
    out = {}
    for name, _type, _flags, _addr, off, size in hdrs:
        end = data.index(b"\0", stroff + name)
        out[data[stroff + name:end].decode()] = data[off:off + size]
    return out


INTERNAL = re.compile(r"_INTERNAL_\w+?_cu_[0-9a-f]+::")


def kernels(path):
    secs = {n[len(".text."):]: b for n, b in sections(path).items() if n.startswith(".text.")}
    names = list(secs)
    demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return {INTERNAL.sub("", d): secs[n] for d, n in zip(demangled.split("\n"), names)}


def pooled(paths):
    """The kernels of several cubins as one set; exits if two of them hold different code under one name."""
    out, where = {}, {}
    for path in paths.split(","):
        for name, code in kernels(path).items():
            if name in out and out[name] != code:
                sys.exit(f"{path} and {where[name]} hold different code for {name}")
            out[name], where[name] = code, path
    return out


def field_moves(x, y):
    """Counter of (only bits 40-55 differ, before − after of that field) over differing instructions."""
    moves = Counter()
    for i in range(0, min(len(x), len(y)), 16):
        u, v = int.from_bytes(x[i:i + 16], "little"), int.from_bytes(y[i:i + 16], "little")
        if u == v:
            continue
        d = u ^ v
        lo, hi = (d & -d).bit_length() - 1, d.bit_length() - 1
        moves[(lo >= 40 and hi < 56, ((u >> 40) & 0xFFFF) - ((v >> 40) & 0xFFFF))] += 1
    return moves


def main():
    args, renames, fields = sys.argv[1:], [], False
    if "--fields" in args:
        args.remove("--fields")
        fields = True
    while "--rename" in args:
        i = args.index("--rename")
        renames.append(tuple(args[i + 1].split("=", 1)))
        del args[i:i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    before, after = pooled(args[0]), pooled(args[1])
    mapped = {}
    for name, code in before.items():
        for old, new in renames:
            name = name.replace(old, new)
        mapped[name] = code
    differ = 0
    for name in sorted(set(mapped) | set(after)):
        if name not in mapped:
            print(f"only after : {name}")
        elif name not in after:
            print(f"only before: {name}")
        elif mapped[name] == after[name]:
            print(f"identical  : {name} ({len(after[name])} bytes)")
        else:
            differ += 1
            line = f"DIFFERENT  : {name} ({len(mapped[name])} -> {len(after[name])} bytes)"
            if fields and len(mapped[name]) == len(after[name]):
                moves = field_moves(mapped[name], after[name])
                line += "; " + ", ".join(
                    f"{n} instructions {'only the constant offset' if only else 'elsewhere'} (field {delta:+d})"
                    for (only, delta), n in sorted(moves.items()))
            print(line)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

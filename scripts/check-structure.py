#!/usr/bin/env python3
"""Structure checks that cargo does not make, run by CI (.ci/run) and by anyone:

    python3 scripts/check-structure.py            # every check, exit 1 on a finding
    python3 scripts/check-structure.py --graph    # also print every module's imports

1. No import cycle between the modules of any crate. A module is a source file (`a/b.rs` or
   `a/b/mod.rs` is `a::b`). Module A depends on module B when A's code names an item that B
   defines, through `use crate::`/`use super::`/`use self::` or an inline `crate::`/`super::`
   path. A re-export (`pub use`) is a facade, not a dependency: a name is followed through
   re-exports to the module that defines it. Declaring a child (`mod b;`) is not a dependency
   either. Test code (`#[cfg(test)] mod ... { }`) is left out: tests may look anywhere.
2. Layers within accelerate-core, as cargo would enforce them between crates: its ground floor
   (the process state, the settings' types and table, the environment reader, the errors, waits) imports
   nothing above it, and `comm` (process group, transports, collectives, rendezvous) imports
   only the ground floor, so that it could become a crate of its own without a change.
3. No library source file over 500 lines, its test module apart. Binaries, examples, benches
   and integration tests are not library code.
4. No `Result<T, String>` in library code: errors are typed (thiserror), so a caller can match
   on them and a message cannot lose its cause.

Only the standard library: CI runs it before anything is built.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES = ["accelerate-core", "kernels", "accelerate-burn", "accelerate-data", "cli"]
MAX_LINES = 500

# Top-level modules of a crate, and the top-level modules each may import (itself aside).
GROUND_FLOOR = {"error", "env_vars", "process", "settings", "setting_table", "state", "wait"}
LAYERS = {
    "accelerate-core": {
        **{m: GROUND_FLOOR for m in GROUND_FLOOR},
        "comm": GROUND_FLOOR,
    },
}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(text: str) -> str:
    """Blanks comments and string literals (keeping newlines), so that braces and paths in
    them are not read as code."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r(#*)"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or (c == "'" and text.startswith("'\\", i)):
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\.|[^\\'])'", text[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(text: str, open_at: int) -> int:
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+" + IDENT + r"\s*\{")


def without_tests(code: str) -> str:
    """The code with its `#[cfg(test)] mod x { ... }` blocks blanked (newlines kept)."""
    while True:
        m = TEST_MOD.search(code)
        if not m:
            return code
        end = matching_brace(code, m.end() - 1)
        code = code[: m.start()] + "\n" * code.count("\n", m.start(), end + 1) + code[end + 1:]


def module_files(src: Path) -> dict[tuple[str, ...], Path]:
    """Each module of a crate (by path) and its file; the crate root is ()."""
    mods: dict[tuple[str, ...], Path] = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).with_suffix("").parts
        if rel[0] == "bin":
            continue
        if rel in (("lib",), ("main",)):
            mods[()] = f
        elif rel[-1] == "mod":
            mods[tuple(rel[:-1])] = f
        else:
            mods[tuple(rel)] = f
    return mods


def split_use_tree(tree: str) -> list[str]:
    """`a::{b, c::{d, e as f}}` -> ["a::b", "a::c::d", "a::c::e"]."""
    tree = re.sub(r"\s+as\s+" + IDENT, "", tree)
    tree = re.sub(r"\s+", "", tree)
    m = re.match(r"^(.*?)\{(.*)\}$", tree)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if not p:
            continue
        for leaf in split_use_tree(p):
            out.append(prefix + leaf)
    return out


USE = re.compile(r"(?m)^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);")
INLINE = re.compile(r"(?<![A-Za-z0-9_:])((?:crate|super|self)(?:::" + IDENT + r")+)")


class Crate:
    def __init__(self, name: str, src: Path):
        self.name = name
        self.mods = module_files(src)
        self.code = {m: without_tests(strip_comments_and_strings(f.read_text())) for m, f in self.mods.items()}
        # Re-exports: module -> {name: absolute path}, and glob re-exports: module -> [module path].
        self.reexports: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = {m: {} for m in self.mods}
        self.globs: dict[tuple[str, ...], list[tuple[str, ...]]] = {m: [] for m in self.mods}
        self.uses: dict[tuple[str, ...], list[tuple[str, ...]]] = {m: [] for m in self.mods}
        for m, code in self.code.items():
            for um in USE.finditer(code):
                public = um.group(1) is not None
                for leaf in split_use_tree(um.group(2)):
                    path = self.absolute(m, leaf)
                    if path is None:
                        continue
                    if public:
                        if path[-1] == "*":
                            self.globs[m].append(path[:-1])
                        else:
                            self.reexports[m][path[-1]] = path
                    else:
                        self.uses[m].append(path)
            for im in INLINE.finditer(USE.sub("", code)):
                path = self.absolute(m, im.group(1))
                if path is not None:
                    self.uses[m].append(path)

    def absolute(self, here: tuple[str, ...], path: str) -> tuple[str, ...] | None:
        """An in-crate path made absolute, or None for another crate's path."""
        segs = [s for s in path.split("::") if s]
        if not segs:
            return None
        if segs[0] == "crate":
            base: list[str] = []
            segs = segs[1:]
        elif segs[0] in ("super", "self"):
            base = list(here)
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    if not base:
                        return None
                    base.pop()
                segs = segs[1:]
        elif here + (segs[0],) in self.mods:
            # A child module named without `self::`.
            base = list(here)
        else:
            return None
        return tuple(base + segs)

    def defining_module(self, path: tuple[str, ...], depth: int = 0) -> tuple[str, ...] | None:
        """The module that defines what `path` names, following re-exports."""
        if depth > 16:
            return None
        # The longest prefix that is a module.
        for k in range(len(path), -1, -1):
            if path[:k] in self.mods:
                mod, rest = path[:k], path[k:]
                break
        else:
            return None
        if not rest or rest == ("*",) or rest[0] == "self":
            return mod
        name = rest[0]
        if name in self.reexports[mod]:
            target = self.reexports[mod][name]
            return self.defining_module(target + rest[1:], depth + 1)
        if re.search(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?(?:const\s+)?(?:async\s+)?(?:fn|struct|enum|trait|type|const|static|union|macro_rules!)\s+" + re.escape(name) + r"\b", self.code[mod]):
            return mod
        for g in self.globs[mod]:
            found = self.defining_module(g + rest, depth + 1)
            if found is not None and found != g:
                return found
        return mod

    def edges(self) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
        graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in self.mods}
        for m, paths in self.uses.items():
            for p in paths:
                target = self.defining_module(p)
                if target is not None and target != m:
                    graph[m].add(target)
        return graph


def cycles(graph: dict) -> list[list]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict = {}
    low: dict = {}
    on_stack: set = set()
    stack: list = []
    out: list = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def string_errors(code: str) -> list[int]:
    """The lines of `code` that write a `Result` whose error type is `String`."""
    found = []
    for m in re.finditer(r"\bResult<", code):
        depth, i, start, args = 1, m.end(), m.end(), []
        while i < len(code) and depth:
            c = code[i]
            if c == "<":
                depth += 1
            elif c == ">" and code[i - 1] != "-":
                depth -= 1
            elif c == "," and depth == 1:
                args.append(code[start:i])
                start = i + 1
            i += 1
        args.append(code[start : i - 1])
        if len(args) == 2 and args[1].strip() in ("String", "std::string::String"):
            found.append(code.count("\n", 0, m.start()) + 1)
    return found


def name(crate: str, mod: tuple[str, ...]) -> str:
    return "::".join((crate,) + mod)


def main() -> int:
    show_graph = "--graph" in sys.argv
    failed = False
    for crate_dir in CRATES:
        src = ROOT / crate_dir / "src"
        crate = Crate(crate_dir, src)
        graph = crate.edges()
        if show_graph:
            for m in sorted(graph):
                print(f"{name(crate_dir, m)} -> {', '.join(name(crate_dir, t) for t in sorted(graph[m])) or '-'}")
        for m, targets in sorted(graph.items()):
            allowed = LAYERS.get(crate_dir, {}).get(m[0] if m else "")
            if allowed is None:
                continue
            for t in sorted(targets):
                top = t[0] if t else ""
                if top != m[0] and top not in allowed:
                    failed = True
                    print(
                        f"layer broken in {crate_dir}: {name(crate_dir, m)} imports "
                        f"{name(crate_dir, t)}; `{m[0]}` may import only {sorted(allowed)}"
                    )
        for comp in cycles(graph):
            failed = True
            print(f"import cycle in {crate_dir}: {', '.join(name(crate_dir, m) for m in comp)}")
            members = set(comp)
            for m in comp:
                inside = sorted(t for t in graph[m] if t in members)
                print(f"    {name(crate_dir, m)} -> {', '.join(name(crate_dir, t) for t in inside)}")
        for m, code in crate.code.items():
            # Trailing blank lines are where a test module was.
            lines = len(code.rstrip().splitlines())
            if lines > MAX_LINES:
                failed = True
                rel = crate.mods[m].relative_to(ROOT)
                print(f"{rel}: {lines} lines of library code, over {MAX_LINES}: split it by concern")
            for line in string_errors(code):
                failed = True
                rel = crate.mods[m].relative_to(ROOT)
                print(f"{rel}:{line}: Result<_, String> in library code: give it a typed error (thiserror)")
    if failed:
        print("structure check: FAILED (see above; scripts/check-structure.py says what it checks)")
        return 1
    print(
        "structure check: no import cycle, layers kept, no library file over 500 lines, "
        "no Result<_, String>"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# Import circles between the files of each crate in crates/*/src (A uses B's items, B uses A's): print them, exit 1 if any (--edges: print every edge).
"""
The graph is file-level: a node is one .rs file (a parent `foo.rs` and its child `foo/bar.rs`
are two). File A points at file B when A names an item that B defines:

- `use` trees (`crate::`, `self::`, `super::`, `$crate::` or a name in scope), globs included;
- paths in code (`crate::x::f()`, `super::T`, `child::f()`, `alias::f()` after `use crate::x as alias`);
- `macro_rules!` macros of another file invoked by name (`#[macro_use]`).

Paths are resolved through the module tree that `mod` declarations build (inline `mod x { }`
included), and through `use` re-exports, so `crate::Thing` re-exported by lib.rs from
`thing.rs` points at thing.rs; a `pub use` is itself a use of the file it names. A `mod`
declaration alone is not a use. Names outside the crate (std, other crates, the prelude) are
ignored.
"""

import os
import re
import sys
from collections import defaultdict

KEYWORDS_ITEM = {"fn", "struct", "enum", "trait", "type", "const", "static", "union"}
# What may stand before an item's keyword (not `*const u8`, not `<const N: usize>`).
ITEM_AFTER = {";", "{", "}", "]", ")", "pub", "unsafe", "async", "extern", "default"}
RAW_STRING = re.compile(r'b?r(#*)"')


# ---------------------------------------------------------------------------- tokens
def tokenize(src):
    """(kind, text, line) tokens: 'id' identifiers/keywords, 'str' strings, 'p' punctuation.
    Comments, numbers, char literals and lifetimes are dropped."""
    toks = []
    i, n, line = 0, len(src), 1
    while i < n:
        c = src[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += src[i] == "\n"
                    i += 1
        elif (m := RAW_STRING.match(src, i)) and (i == 0 or not is_ident_char(src[i - 1])):
            close = '"' + m.group(1)
            j = src.find(close, m.end())
            j = n if j < 0 else j
            text = src[m.end():j]
            toks.append(("str", text, line))
            line += text.count("\n")
            i = j + len(close)
        elif c == '"' or (c == "b" and src.startswith('b"', i)):
            j = i + (2 if c == "b" else 1)
            start = j
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            text = src[start:j]
            toks.append(("str", text, line))
            line += text.count("\n")
            i = j + 1
        elif c == "'":
            if i + 1 < n and src[i + 1] == "\\":  # escaped char literal
                j = src.find("'", i + 2 + (src[i + 2] == "'"))
                i = j + 1
            elif i + 2 < n and src[i + 2] == "'":  # 'x'
                i += 3
            else:  # lifetime or label
                i += 1
                while i < n and is_ident_char(src[i]):
                    i += 1
        elif src.startswith("r#", i) and i + 2 < n and is_ident_char(src[i + 2]):
            j = i + 2
            while j < n and is_ident_char(src[j]):
                j += 1
            toks.append(("id", src[i + 2:j], line))
            i = j
        elif c.isdigit():
            j = i + 1
            while j < n and (is_ident_char(src[j]) or (src[j] == "." and j + 1 < n and src[j + 1].isdigit())):
                j += 1
            i = j
        elif is_ident_char(c):
            j = i + 1
            while j < n and is_ident_char(src[j]):
                j += 1
            toks.append(("id", src[i:j], line))
            i = j
        elif src.startswith("::", i):
            toks.append(("p", "::", line))
            i += 2
        elif c == "$" and src.startswith("$crate", i):
            toks.append(("id", "crate", line))
            i += 6
        else:
            toks.append(("p", c, line))
            i += 1
    return toks


def is_ident_char(c):
    return c.isalnum() or c == "_"


# ---------------------------------------------------------------------------- modules
class Module:
    def __init__(self, name, file, parent, child_dir):
        self.name = name
        self.file = file  # the .rs file holding this module's body
        self.parent = parent
        self.child_dir = child_dir  # where `mod x;` inside it looks for x.rs / x/mod.rs
        self.children = {}  # name -> Module
        self.items = set()  # names defined here (fn, struct, ...)
        self.uses = defaultdict(list)  # alias -> [path segments]
        self.globs = []  # [(path segments, line)]
        self.idents = set()  # plain names used in its code, which a glob may supply

    def root(self):
        m = self
        while m.parent:
            m = m.parent
        return m


class Crate:
    def __init__(self, src_dir, root_file):
        self.src_dir = src_dir
        self.files = {}  # path -> tokens
        self.uses = []  # (module, segments, alias, line, file)
        self.code_paths = []  # (module, segments, line, file)
        self.macro_calls = []  # (name, line, file)
        self.macros = {}  # macro_rules name -> defining file
        self.root = Module("crate", root_file, None, src_dir)
        self.load(self.root)

    def load(self, module):
        path = module.file
        with open(path, encoding="utf-8") as f:
            toks = tokenize(f.read())
        self.files[path] = toks
        self.parse(toks, module)

    def parse(self, toks, file_module):
        path = file_module.file
        stack = [(file_module, 0)]  # (module, brace depth of its body)
        depth = 0
        path_attr = None
        i, n = 0, len(toks)
        while i < n:
            kind, text, line = toks[i]
            module, body_depth = stack[-1]
            if kind == "p" and text == "{":
                depth += 1
            elif kind == "p" and text == "}":
                depth -= 1
                if depth < body_depth:
                    stack.pop()
            elif kind == "p" and text == "#" and i + 4 < n and [t[1] for t in toks[i + 1:i + 4]] == ["[", "path", "="]:
                path_attr = toks[i + 4][1]
            elif kind == "id" and text == "mod" and i + 2 < n and toks[i + 1][0] == "id":
                name = toks[i + 1][1]
                if toks[i + 2][1] == ";":
                    self.declare_file_module(module, name, path_attr, line)
                    path_attr = None
                    i += 3
                    continue
                if toks[i + 2][1] == "{":
                    child = Module(name, path, module, os.path.join(module.child_dir, name))
                    module.children[name] = child
                    depth += 1
                    stack.append((child, depth))
                    path_attr = None
                    i += 3
                    continue
            elif kind == "id" and text == "use" and (i == 0 or toks[i - 1][1] != "::"):
                j, trees = parse_use_tree(toks, i + 1, [])
                for segs, alias in trees:
                    if alias == "*":
                        module.globs.append((segs, line))
                        continue  # its edges are the names the module uses from it
                    elif alias != "_" and alias is not None:
                        module.uses[alias].append(segs)
                    self.uses.append((module, segs, alias, line, path))
                i = j
                continue
            elif kind == "id" and text == "macro_rules" and i + 2 < n and toks[i + 1][1] == "!":
                if depth == body_depth:
                    self.macros[toks[i + 2][1]] = path
                i += 3
                continue
            elif (
                kind == "id"
                and text in KEYWORDS_ITEM
                and depth == body_depth
                and i + 1 < n
                and (i == 0 or toks[i - 1][0] == "str" or toks[i - 1][1] in ITEM_AFTER)
            ):
                nxt = toks[i + 1]
                if nxt[0] == "id" and nxt[1] not in KEYWORDS_ITEM | {"unsafe", "extern", "async", "_"}:
                    module.items.add(nxt[1])
            elif kind == "id" and i + 1 < n and toks[i + 1][1] == "!" and (i == 0 or toks[i - 1][1] not in ("::", ".")):
                self.macro_calls.append((text, line, path))
            elif kind == "id" and i + 1 < n and toks[i + 1][1] != "::" and (i == 0 or toks[i - 1][1] not in ("::", ".")):
                module.idents.add(text)
            elif kind == "id" and i + 2 < n and toks[i + 1][1] == "::" and toks[i + 2][0] == "id":
                prev = toks[i - 1][1] if i else ""
                if prev not in ("::", "."):
                    segs = [text]
                    j = i + 1
                    while j + 1 < n and toks[j][1] == "::" and toks[j + 1][0] == "id":
                        segs.append(toks[j + 1][1])
                        j += 2
                    self.code_paths.append((module, segs, line, path))
                    i = j
                    continue
            i += 1

    def declare_file_module(self, parent, name, path_attr, line):
        if path_attr:
            mod_rs = parent.file == parent.root().file or parent.file.endswith("mod.rs")
            base = os.path.dirname(parent.file) if mod_rs else parent.child_dir
            candidates = [os.path.normpath(os.path.join(base, path_attr))]
        else:
            candidates = [
                os.path.join(parent.child_dir, name + ".rs"),
                os.path.join(parent.child_dir, name, "mod.rs"),
            ]
        for c in candidates:
            if os.path.isfile(c):
                child_dir = os.path.dirname(c) if c.endswith("mod.rs") else os.path.join(os.path.dirname(c), name)
                child = Module(name, c, parent, child_dir)
                parent.children[name] = child
                self.load(child)
                return
        print(f"warning: {parent.file}:{line}: `mod {name};` has no file ({' or '.join(candidates)})", file=sys.stderr)

    # ------------------------------------------------------------------ resolution
    def resolve(self, module, segs, seen=None):
        """Where `segs`, written in `module`, leads: ('mod', Module) or ('item', file), or None
        when it leaves the crate."""
        if seen is None:
            seen = set()
        if not segs:
            return ("mod", module)
        first, rest = segs[0], segs[1:]
        if first == "crate":
            cur = module.root()
        elif first == "self":
            cur = module
        elif first == "super":
            cur = module
            while segs and segs[0] == "super":
                cur = cur.parent or cur
                segs = segs[1:]
            rest = segs
        elif first == "Self":
            return ("item", module.file)
        else:
            found = self.lookup(module, first, seen)
            if found is None:
                return None
            if found[0] == "item":
                return found
            cur = found[1]
        return self.walk(cur, rest, seen)

    def walk(self, cur, segs, seen):
        for k, name in enumerate(segs):
            if name == "self":
                continue
            if name == "super":
                cur = cur.parent or cur
                continue
            found = self.lookup(cur, name, seen)
            if found is None:
                return ("item", cur.file)  # defined where we cannot see (macro output)
            if found[0] == "item":
                return found
            cur = found[1]
        return ("mod", cur)

    def lookup(self, module, name, seen):
        key = (id(module), name)
        if key in seen:
            return None
        seen = seen | {key}
        if name in module.children:
            return ("mod", module.children[name])
        if name in module.items:
            return ("item", module.file)
        for segs in module.uses.get(name, []):
            r = self.resolve(module, segs, seen)
            if r is not None:
                return r
        for segs, _ in module.globs:
            g = self.resolve(module, segs, seen)
            if g is not None and g[0] == "mod":
                r = self.lookup(g[1], name, seen)
                if r is not None:
                    return r
        return None

    def modules(self):
        todo = [self.root]
        while todo:
            m = todo.pop()
            yield m
            todo.extend(m.children.values())

    def target_file(self, r):
        if r is None:
            return None
        return r[1].file if r[0] == "mod" else r[1]

    def edges(self):
        """{(from, to): [(line, text)]} between different files."""
        out = defaultdict(list)

        def add(src, r, line, text):
            dst = self.target_file(r)
            if dst and dst != src:
                out[(src, dst)].append((line, text))

        for module, segs, alias, line, path in self.uses:
            add(path, self.resolve(module, segs), line, "use " + "::".join(segs) + ("::*" if alias == "*" else ""))
        for module, segs, line, path in self.code_paths:
            add(path, self.resolve(module, segs), line, "::".join(segs))
        for module in self.modules():
            for segs, line in module.globs:
                g = self.resolve(module, segs)
                if g is None or g[0] != "mod":
                    continue
                for name in sorted(module.idents):
                    if name in module.items or name in module.children or name in module.uses:
                        continue
                    r = self.lookup(g[1], name, set())
                    if r is None or r[0] == "mod":
                        continue  # a bare name is no module (a local variable of that name)
                    add(module.file, r, line, "use " + "::".join(segs) + "::* for " + name)
        for name, line, path in self.macro_calls:
            if name in self.macros:
                add(path, ("item", self.macros[name]), line, name + "!")
        return out


def parse_use_tree(toks, i, prefix):
    """Parses a use tree from toks[i]; returns (index after the `;`/`,`/`}` it stops before or
    the `;` it ends at, [(segments, alias)]); alias '*' is a glob, None means the last segment."""
    out = []
    segs = list(prefix)
    n = len(toks)
    if i < n and toks[i][1] == "::":
        i += 1
    while i < n:
        kind, text, _ = toks[i]
        if kind == "id" and text != "as":
            segs.append(text)
            i += 1
            if i < n and toks[i][1] == "::":
                i += 1
                continue
            alias = segs[-1]
            if i + 1 < n and toks[i][1] == "as":
                alias = toks[i + 1][1]
                i += 2
            if segs[-1] == "self":
                segs = segs[:-1]
                alias = alias if alias != "self" else (segs[-1] if segs else None)
            out.append((segs, alias))
            break
        if text == "*":
            out.append((segs, "*"))
            i += 1
            break
        if text == "{":
            i += 1
            while i < n and toks[i][1] != "}":
                i, sub = parse_use_tree(toks, i, segs)
                out.extend(sub)
                if i < n and toks[i][1] == ",":
                    i += 1
            i += 1
            break
        i += 1  # stray token: skip
    if prefix == [] and i < n and toks[i][1] == ";":
        i += 1
    return i, out


# ---------------------------------------------------------------------------- cycles
def strongly_connected(nodes, adj):
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adj.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def shortest_cycle(start, comp, adj):
    """Shortest path start -> ... -> start inside comp (breadth first)."""
    prev = {start: None}
    queue = [start]
    for v in queue:
        for w in sorted(adj.get(v, ())):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w in comp and w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def main():
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    os.chdir(root)
    found = 0
    for crate_dir in sorted(os.listdir("crates")):
        src = os.path.join("crates", crate_dir, "src")
        for root_name in ("lib.rs", "main.rs"):
            root_file = os.path.join(src, root_name)
            if not os.path.isfile(root_file):
                continue
            crate = Crate(src, root_file)
            edges = crate.edges()
            if "--edges" in sys.argv:
                for (a, b), refs in sorted(edges.items()):
                    print(f"{a} -> {b}  [{', '.join(f'{ln}: {t}' for ln, t in refs[:3])}]")
            adj = defaultdict(set)
            for a, b in edges:
                adj[a].add(b)
            for comp in strongly_connected(crate.files.keys(), adj):
                if len(comp) < 2:
                    continue
                found += 1
                print(f"circle in {root_file}: {', '.join(comp)}")
                members = set(comp)
                cycle = shortest_cycle(comp[0], members, adj)
                if cycle:
                    print("  " + " -> ".join(cycle))
                for a in comp:
                    for b in sorted(adj[a] & members):
                        refs = edges[(a, b)]
                        shown = ", ".join(f"{ln}: {t}" for ln, t in refs[:3])
                        more = f" (+{len(refs) - 3})" if len(refs) > 3 else ""
                        print(f"    {a} -> {b}  [{shown}{more}]")
    if found:
        print(f"{found} import circle(s) between files; see ARCHITECTURE.md (arrows point down only)")
        return 1
    print("no import circles between files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The structure rules of crates/gateway/src and crates/core/src, checked in CI (scripts/test.sh).

- Layers: the gateway's top-level modules form a stack (LAYERS, bottom first); a module may
  import (`crate::x`) only from its own layer or a layer below it. The engine's types (`Shared`,
  `JobGuard`, `CoreState`) get inherent methods only inside `engine/`, so no method hides an
  import that would point up.
- No import circle among the top-level modules of either crate.
- No non-test file over MAX_FILE_LINES lines, no function over MAX_FN_LINES lines.

Text-based, like ../shared/tools/structure.py, whose measures it repeats (test files and
`#[cfg(test)] mod x { ... }` blocks do not count; a function runs from its `fn` line to the
brace that closes it at its indent). Exits 1 with one line per violation.
usage: scripts/check-structure.py [REPO_ROOT] [--self-test]
(--self-test first spoils a copy of the crates and checks that each spoiling is caught)
"""
import os
import re
import sys

MAX_FILE_LINES = 700
MAX_FN_LINES = 80

# Bottom first. `(root)` is lib.rs, which declares the modules and re-exports a few names.
LAYERS = [
    ["support"],
    ["wire"],
    ["config"],
    ["ledger_store"],
    ["upstream"],
    ["observe"],
    ["http"],
    ["engine"],
    ["pipeline"],
    ["cluster"],
    ["ops"],
    ["server"],
    ["(root)"],
]
# Pairs that may not import each other although the layers allow it: cluster forwarding wraps
# the request pipeline as a handler it is given (`cluster::Local`, which `server` implements)
# and never names it.
FORBIDDEN = {("cluster", "pipeline")}
# Names lib.rs re-exports, and the module each comes from.
ROOT_REEXPORTS = {"Config": "config", "DecisionLog": "observe", "run": "server",
                  "run_with": "server", "Gateway": "server", "GatewayOptions": "server"}
ENGINE_TYPES = ["Shared", "JobGuard", "CoreState"]


def is_test_path(rel):
    return bool(re.search(r'(^|/)tests?(\.rs|/)|_tests\.rs$|/benches/', "/" + rel))


def strip_tests(text):
    """Drop `#[cfg(test)] mod x { ... }` blocks laid out by rustfmt."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.startswith("#[cfg(test)]") and re.match(r"(pub(\(\w+\))? )?mod \w+ \{", nxt):
            j = i + 2
            while j < len(lines) and lines[j] != "}":
                j += 1
            i = j + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def functions(text):
    res, lines = [], text.split("\n")
    for i, line in enumerate(lines):
        m = re.match(r'^(\s*)(pub(\([^)]*\))? )?(const )?(async )?(unsafe )?(extern "C" )?fn (\w+)', line)
        if not m:
            continue
        ind = m.group(1)
        for j in range(i, len(lines)):
            if lines[j] == ind + "}" or (
                j > i and lines[j].startswith(ind + "}") and lines[j].strip() in ("}", "};", "},")
            ):
                res.append((m.group(8), i + 1, j - i + 1))
                break
            if lines[j].rstrip().endswith(";") and j == i:
                break
    return res


def module_path(rel):
    """`engine/replica/lease.rs` -> [engine, replica, lease]; `engine/mod.rs` -> [engine]."""
    parts = rel[:-3].split("/") if rel.endswith(".rs") else rel.split("/")
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def group_items(text, start):
    """The top-level items of the use-tree group opening at text[start] == '{' (nested groups
    skipped whole), each as its first identifier."""
    depth, item, items = 0, "", []
    for ch in text[start:]:
        if ch == "{":
            depth += 1
            if depth == 1:
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                items.append(item)
                break
        if depth == 1 and ch == ",":
            items.append(item)
            item = ""
        elif depth >= 1:
            item += ch
    names = []
    for it in items:
        m = re.match(r"\s*(\w+)", it)
        if m:
            names.append(m.group(1))
    return names


def refs(text, rel="lib.rs"):
    """The top-level modules a file names: `crate::x`, `crate::{x, y::{..}}`, and `super::`
    paths resolved from the file's own place (`super::super::x` from `a/b/c.rs` is `a`)."""
    here = module_path(rel)
    found = set()
    for m in re.finditer(r"\b(crate|(?:super::)*super)::(\{|\w+)", text):
        head, nxt = m.group(1), m.group(2)
        names = group_items(text, m.start(2)) if nxt == "{" else [nxt]
        if head == "crate":
            base = []
        else:
            ups = head.count("super")
            base = here[:-ups] if ups <= len(here) else []
        for n in names:
            if n in ("self", "super", "crate"):
                continue
            found.add(base[0] if base else n)
    return found


def sources(src):
    for root, _, names in os.walk(src):
        for n in sorted(names):
            if n.endswith(".rs"):
                p = os.path.join(root, n)
                rel = os.path.relpath(p, src)
                if not is_test_path(rel):
                    yield p, rel


def top_of(rel):
    top = rel.split("/")[0]
    top = top[:-3] if top.endswith(".rs") else top
    return "(root)" if top in ("lib", "main") else top


def cycles(nodes, edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def check_crate(src, layered):
    problems, nodes, edges = [], set(), {}
    rank = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    for path, rel in sources(src):
        raw = open(path, encoding="utf-8").read()
        text = strip_tests(raw)
        top = top_of(rel)
        nodes.add(top)
        n_lines = text.count("\n") + 1
        if n_lines > MAX_FILE_LINES:
            problems.append(f"{path}: {n_lines} lines (at most {MAX_FILE_LINES} outside tests)")
        for name, line, length in functions(text):
            if length > MAX_FN_LINES:
                problems.append(f"{path}:{line}: fn {name} is {length} lines (at most {MAX_FN_LINES})")
        for r in refs(text, rel):
            if r in ROOT_REEXPORTS and layered:
                r = ROOT_REEXPORTS[r]
            if r != top:
                edges.setdefault(top, set()).add(r)
        if not layered:
            continue
        if top not in rank:
            problems.append(f"{path}: top-level module `{top}` is in no layer (scripts/check-structure.py LAYERS)")
            continue
        for r in sorted(refs(text, rel)):
            target = ROOT_REEXPORTS.get(r, r)
            if target not in rank:
                if re.search(r"\bcrate::" + r + r"\b", text) and r[0].islower():
                    problems.append(f"{path}: `crate::{r}` names no layer")
                continue
            if rank[target] > rank[top]:
                problems.append(f"{path}: `{top}` imports `crate::{r}`, a layer above it")
            if (top, target) in FORBIDDEN:
                problems.append(f"{path}: `{top}` may not import `{target}` (FORBIDDEN)")
        if not rel.startswith("engine/"):
            for t in ENGINE_TYPES:
                if re.search(r"\bstruct " + t + r"\b", text):
                    continue  # a type of the same name, local to this file
                if re.search(r"^impl(<[^>]*>)? " + t + r"\b", text, re.M):
                    problems.append(f"{path}: `impl {t}` outside engine/ (methods there hide an import)")
    edges = {a: {b for b in bs if b in nodes} for a, bs in edges.items()}
    for c in cycles(nodes, edges):
        problems.append(f"{src}: import circle among {', '.join(c)}")
    return problems


def self_test(root):
    """The check catches what it is for: a copy of the two crates, spoiled several ways
    (imports pointing up, plain, in a nested group and through `super::`; the cluster naming
    the pipeline; a circle in the core; a long function), must be refused for each."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for crate in ("gateway", "core"):
            shutil.copytree(os.path.join(root, "crates", crate, "src"),
                            os.path.join(tmp, "crates", crate, "src"))
        clean = check_crate(os.path.join(tmp, "crates/gateway/src"), True)
        clean += check_crate(os.path.join(tmp, "crates/core/src"), False)
        spoiled = {
            "crates/gateway/src/wire/url.rs": "\nuse crate::pipeline::proxy;\n",
            "crates/gateway/src/http/body.rs":
                "\nuse crate::{support::{clock}, ops::control};\n",
            "crates/gateway/src/engine/replica/beat.rs": "\nuse super::super::super::server;\n",
            "crates/gateway/src/cluster/mod.rs": "\nuse crate::pipeline::proxy;\n",
            "crates/core/src/estimator.rs": "\nuse crate::gate::Gate;\n",
            "crates/gateway/src/support/clock.rs":
                "\nfn long_one() {\n" + "    let _ = 1;\n" * (MAX_FN_LINES + 1) + "}\n",
        }
        for rel, extra in spoiled.items():
            with open(os.path.join(tmp, rel), "a", encoding="utf-8") as f:
                f.write(extra)
        found = check_crate(os.path.join(tmp, "crates/gateway/src"), True)
        found += check_crate(os.path.join(tmp, "crates/core/src"), False)
        expect = [
            "`wire` imports `crate::pipeline`, a layer above it",
            "`http` imports `crate::ops`, a layer above it",
            "`engine` imports `crate::server`, a layer above it",
            "`cluster` may not import `pipeline`",
            "import circle among",
            "fn long_one is",
        ]
        missed = [e for e in expect if not any(e in p for p in found if p not in clean)]
        if missed:
            print(f"check-structure self-test: not caught: {missed}", file=sys.stderr)
            sys.exit(1)
        print("check-structure self-test: upward imports (plain, nested, super::), the cluster naming the pipeline, a circle and a long function are caught")


def main():
    root = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "--self-test" else os.path.join(
        os.path.dirname(__file__), "..")
    if "--self-test" in sys.argv:
        self_test(root)
    sys.setrecursionlimit(10000)
    problems = check_crate(os.path.join(root, "crates/gateway/src"), True)
    problems += check_crate(os.path.join(root, "crates/core/src"), False)
    for p in problems:
        print(p)
    if problems:
        print(f"check-structure: {len(problems)} problem(s)", file=sys.stderr)
        sys.exit(1)
    print("check-structure: layers, circles, file and function sizes hold")


if __name__ == "__main__":
    main()

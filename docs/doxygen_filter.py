#!/usr/bin/env python3
"""Doxygen input filter for memattn's public headers (docs/Doxyfile.in, FILTER_PATTERNS).

Every header opens with a plain `//` comment (after `#pragma once`) that says what the
file is for; the doc comments in it refer to it as "the top of the file". Doxygen ignores
plain comments, so this filter hands that comment to Doxygen as the file's documentation,
and the headers carry no Doxygen markup for it:

  - a `/// \\file` block, appended after the file's last line: the comment's first
    sentence is the brief, then the whole comment as written, in a fenced block (its
    ASCII formulas, tables and code keep their layout, and nothing in it is read as
    Markdown, a Doxygen command or an HTML tag);
  - a header under kernels/, memory/, layer/, serving/, persistence/, storage/ or distributed/
    (and feature_maps.hpp, softmax_state.hpp: kernels) joins that group of the reference
    (docs/groups.dox): the file by \\ingroup, and everything documented in its
    `namespace memattn { ... }` blocks by `\\addtogroup` and `@{ ... @}` comments added on
    the lines that open and close each block.

No line moves, so Doxygen's warnings point at the header's own lines. The detail/
directories are not part of the API and pass through unchanged, as does a header without
a top comment. The filtered header goes to stdout; the source listings
(VERBATIM_HEADERS) show the original. `doxygen_filter.py --cache <dir> <out>` filters
every header under <dir> into <out> at once (what the docs target runs first).
"""

import os
import re
import sys

GROUPS = {
    "kernels": "kernels",
    "memory": "memories",
    "layer": "layer",
    "persistence": "persistence",
    "storage": "storage",
    "distributed": "distributed",
    "serving": "serving",
}
OPENING = re.compile(r"^namespace memattn\s*\{\s*$")
CLOSING = re.compile(r"^\}\s*//\s*namespace memattn\s*$")
TOP_LEVEL_GROUPS = {"feature_maps.hpp": "kernels", "softmax_state.hpp": "kernels"}

# The brief's text is read by Doxygen (Markdown, commands, HTML): escape what it would
# take as markup. Backquoted code spans stay code spans.
_ESCAPES = {c: "\\" + c for c in "\\@&$#<>%"}


def group_of(path):
    rel = include_name(path).split("/")[1:]
    if len(rel) == 1:
        return TOP_LEVEL_GROUPS.get(rel[0])
    return GROUPS.get(rel[0])


def include_name(path):
    """The header's name as it is included: memattn/memory/kv_cache.hpp."""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[len(parts) - 1 - parts[::-1].index("memattn"):])


def first_sentence(text_lines):
    """The comment's first sentence, from its first paragraph, on one line."""
    paragraph = []
    for line in text_lines:
        if not line.strip():
            break
        paragraph.append(line.strip())
    text = " ".join(paragraph)
    # A sentence ends at a full stop followed by a space, not after "e.g." or "et al.".
    match = re.search(r"(?<!e\.g)(?<!i\.e)(?<! al)(?<!etc)\.(\s|$)", text)
    if match:
        text = text[: match.start() + 1]
    text = "".join(_ESCAPES.get(c, c) for c in text)
    # Doxygen ends a brief at the first ". " (JAVADOC_AUTOBRIEF): ".\\ " keeps it going.
    return re.sub(r"\.(?= )", ".\\\\", text)


def is_plain_comment(line):
    stripped = line.lstrip()
    return stripped.startswith("//") and not stripped.startswith("///") and not stripped.startswith("//!")


def filter_header(path, lines):
    if "/detail/" in path.replace("\\", "/"):
        return lines
    if not lines or lines[0].strip() != "#pragma once":
        return lines
    start = end = 1
    while end < len(lines) and is_plain_comment(lines[end]):
        end += 1
    if end == start:
        return lines
    body = [lines[i].lstrip()[2:].rstrip() for i in range(start, end)]
    group = group_of(path)
    out = list(lines)
    if not out[-1].endswith("\n"):
        out[-1] += "\n"
    if group:
        # Everything documented in the namespace memattn blocks of the file joins the
        # group (around the namespace, `@{ @}` would group the namespace, not its members):
        # \addtogroup and `@{` in two blocks (a title would take the rest of the line)
        # after each `namespace memattn {`, `@}` before its `}  // namespace memattn`.
        inside = False
        for i, line in enumerate(out):
            if not inside and OPENING.match(line):
                out[i] = line.rstrip("\n") + " /** \\addtogroup " + group + " */ /** @{ */\n"
                inside = True
            elif inside and CLOSING.match(line):
                out[i] = "/** @} */ " + line
                inside = False
    # The file's own block, after everything else so that no line moves: the brief, then
    # the comment as written in a fenced block (no Markdown, commands or HTML inside).
    # Doxygen would print a `*/` of the text as "*&zwj;/": a zero-width joiner keeps the
    # pair apart instead.
    out.append("/// \\file " + include_name(path) + "\n")
    if group:
        out.append("/// \\ingroup " + group + "\n")
    out.append("/// \\brief " + first_sentence(body) + "\n")
    out.append("///\n")
    out.append("/// ~~~{.unparsed}\n")
    out.extend(("///" + text.replace("*/", "*\u200d/")).rstrip() + "\n" for text in body)
    out.append("/// ~~~\n")
    return out


def write_cache(root, out_root):
    """Every header under `root` filtered into the same path under `out_root`: Doxygen
    runs its filter on a header twice, and each run of it is a Python process (0.3 s
    to start on a VM, two thirds of the reference's build); the docs target runs this
    once before Doxygen, whose filter (doxygen_filter.sh) then reads the result."""
    for directory, _, names in os.walk(root):
        for name in sorted(names):
            if not name.endswith(".hpp"):
                continue
            path = os.path.join(directory, name)
            target = os.path.join(out_root, os.path.relpath(path, root))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
            with open(target, "w", encoding="utf-8") as f:
                f.write("".join(filter_header(path, lines)))


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--cache":
        write_cache(sys.argv[2], sys.argv[3])
        return
    path = sys.argv[1]
    sys.stdout.reconfigure(encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    sys.stdout.write("".join(filter_header(path, lines)))


if __name__ == "__main__":
    main()

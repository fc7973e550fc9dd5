"""docs/contributing.md's recipes against the tree.

Each recipe ("## A new ...") lists the files a change touches in tables whose
first column is headed "file". For every such table, and for every path the
recipes' prose names in backquotes:

* a plain path (`tensor/backend.h`) must exist in the tree, a folder
  (`data/`) too;
* a path with a wildcard (`tensor/ops_*.c`) must match at least one file;
* a path marked "(new)", or one naming the recipe's placeholder (`foo`,
  `Foo`: `tensor/cpu/foo.c`), is a file the change adds: its folder must
  exist;
* an include name (`nabla/nn.h`) is looked up under include/.

Where the prose just before a table states how many files it lists ("thirteen
files", "four source files"), the table must name that many: "N files"
counts every path in the file column, "N source files" those outside docs/.
The introduction's count of recipes ("four recipes") must equal the number
of "## A new ..." sections. So a recipe cannot name a file that moved or
went, nor lose a row its count promises.
"""
import glob
import os
import re
import sys

SOURCE = os.environ.get("NABLA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(SOURCE, "docs", "contributing.md")

NUMBERS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty".split())}
NUMBER = r"(\d+|" + "|".join(NUMBERS) + r")"
# A path in backquotes: folders and a name, no spaces; at least one slash.
PATH = re.compile(r"^[A-Za-z0-9_.*\-]+(?:/[A-Za-z0-9_.*\-]+)*/?$")
PLACEHOLDER = re.compile(r"foo", re.I)

errors = []


def number(word):
    word = word.lower()
    return int(word) if word.isdigit() else NUMBERS[word]


def is_path(span):
    return "/" in span and PATH.match(span) is not None


def check_path(path, new, where):
    """Appends to errors when path, named at where, is not in the tree."""
    rel = path
    if rel.startswith("nabla/"):  # an include name
        rel = "include/" + rel
    full = os.path.join(SOURCE, rel)
    if new or PLACEHOLDER.search(os.path.basename(rel.rstrip("/"))):
        folder = os.path.dirname(rel.rstrip("/"))
        if not os.path.isdir(os.path.join(SOURCE, folder)):
            errors.append("%s: `%s` is a file to add, but its folder %s/ is not in the tree"
                          % (where, path, folder))
        return
    if "*" in rel:
        if not glob.glob(full):
            errors.append("%s: `%s` matches no file in the tree" % (where, path))
        return
    if rel.endswith("/"):
        if not os.path.isdir(full):
            errors.append("%s: the folder `%s` is not in the tree" % (where, path))
    elif not os.path.exists(full):
        errors.append("%s: `%s` is not in the tree" % (where, path))


def sections(lines):
    """[(title, first line number, lines)] for each "## " section."""
    out = []
    for i, line in enumerate(lines):
        if line.startswith("## "):
            out.append([line[3:].strip(), i + 1, []])
        elif out:
            out[-1][2].append(line)
    return [tuple(s) for s in out]


def cells(row):
    return [c.strip() for c in row.strip().strip("|").split("|")]


def check_recipe(title, start, body):
    """Checks one recipe section; returns the number of file tables in it."""
    tables = 0
    prose = []  # the lines since the last table, where a count may be stated
    i = 0
    while i < len(body):
        line = body[i]
        in_table = line.lstrip().startswith("|")
        if in_table and i + 1 < len(body) and re.match(r"^\s*\|[\s|:\-]+\|\s*$", body[i + 1]):
            header = cells(line)
            j = i + 2
            rows = []
            while j < len(body) and body[j].lstrip().startswith("|"):
                rows.append((start + j + 1, cells(body[j])))
                j += 1
            if header and header[0].lower() == "file":
                tables += 1
                check_table(title, start + i + 1, rows, " ".join(prose))
            prose = []
            i = j
            continue
        if line.startswith("```"):  # code blocks name no files of the tree
            j = i + 1
            while j < len(body) and not body[j].startswith("```"):
                j += 1
            i = j + 1
            continue
        for span in re.findall(r"`([^`]+)`", line):
            if is_path(span):
                check_path(span, False, "contributing.md:%d (%s)" % (start + i + 1, title))
        prose.append(line)
        i += 1
    return tables


def check_table(title, line, rows, prose):
    where = "contributing.md:%d (%s)" % (line, title)
    paths = []
    for row_line, row in rows:
        first = row[0]
        spans = [s for s in re.findall(r"`([^`]+)`", first) if is_path(s)]
        if not spans:
            errors.append("contributing.md:%d (%s): the row names no file: %s" % (row_line, title, first))
        new = "(new)" in first
        for s in spans:
            check_path(s, new, "contributing.md:%d (%s)" % (row_line, title))
            paths.append(s)
        for cell in row[1:]:
            for s in re.findall(r"`([^`]+)`", cell):
                if is_path(s):
                    check_path(s, False, "contributing.md:%d (%s)" % (row_line, title))
    # The count stated last before the table is the one about it.
    stated = re.findall(r"\b" + NUMBER + r"\s+(source\s+)?files\b", prose, re.I)
    if not stated:
        return
    word, source = stated[-1]
    want = number(word)
    if source:
        have = [p for p in paths if not p.startswith("docs/")]
        kind = "source files (outside docs/)"
    else:
        have = paths
        kind = "files"
    if len(have) != want:
        errors.append("%s: the text says %s %sfiles, the table names %d %s: %s"
                      % (where, word, source, len(have), kind, ", ".join(have)))


def main():
    if not os.path.exists(DOC):
        print("FAIL: %s not found" % DOC)
        sys.exit(1)
    lines = open(DOC, encoding="utf-8").read().split("\n")
    recipes = [s for s in sections(lines) if s[0].lower().startswith("a new ")]
    if not recipes:
        print("FAIL: contributing.md has no \"## A new ...\" recipe")
        sys.exit(1)
    for title, start, body in recipes:
        if check_recipe(title, start, body) == 0:
            errors.append("contributing.md:%d (%s): the recipe has no table of files (first column \"file\")"
                          % (start, title))
    intro = " ".join(lines[:8])
    m = re.search(r"\b" + NUMBER + r"\s+recipes\b", intro, re.I)
    if not m:
        errors.append("contributing.md: the introduction does not say how many recipes it has")
    elif number(m.group(1)) != len(recipes):
        errors.append("contributing.md: the introduction says %s recipes, the page has %d (%s)"
                      % (m.group(1), len(recipes), ", ".join(r[0] for r in recipes)))
    if errors:
        print("FAIL: docs/contributing.md names files the tree does not have, or miscounts them:")
        for e in errors:
            print("  " + e)
        sys.exit(1)
    print("ok: %d recipes" % len(recipes))


if __name__ == "__main__":
    main()

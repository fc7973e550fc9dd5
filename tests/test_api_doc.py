"""docs/api.md against the public headers.

Every public function declared in include/nabla/*.h (a name nb_... at file
scope followed by an opening parenthesis, in a declaration or a static
inline definition) must appear in docs/api.md, and every nb_ function name
that docs/api.md lists as a function (written `nb_name(`) must exist in a
header, so the overview can neither miss a function nor keep one that is
gone.
"""
import glob
import os
import re
import sys

SOURCE = os.environ.get("NABLA_SOURCE_DIR",
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_functions():
    """{name: header} for the functions declared at file scope."""
    found = {}
    for path in sorted(glob.glob(os.path.join(SOURCE, "include", "nabla", "*.h"))):
        text = strip_comments(open(path).read())
        # C++ guards (extern "C" { ... }) and other preprocessor lines
        text = re.sub(r"#ifdef __cplusplus.*?#endif", " ", text, flags=re.S)
        text = re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)  # preprocessor lines
        depth = 0
        scope = []  # file-scope text, brace bodies removed
        for ch in text:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif depth == 0:
                scope.append(ch)
        for m in re.finditer(r"\b(nb_[a-z0-9_]+)\s*\(", "".join(scope)):
            found.setdefault(m.group(1), os.path.basename(path))
    return found


def main():
    funcs = header_functions()
    if len(funcs) < 100:
        fail("found only %d functions in include/nabla/*.h: the parser is broken" % len(funcs))
    doc = open(os.path.join(SOURCE, "docs", "api.md")).read()
    named = set(re.findall(r"`(nb_[a-z0-9_]+)\(", doc))
    missing = sorted(n for n in funcs if n not in named)
    if missing:
        fail("docs/api.md does not list %d public functions: %s"
             % (len(missing), ", ".join("%s (%s)" % (n, funcs[n]) for n in missing)))
    unknown = sorted(n for n in named if n not in funcs)
    if unknown:
        fail("docs/api.md lists functions that no header declares: " + ", ".join(unknown))
    for h in sorted(glob.glob(os.path.join(SOURCE, "include", "nabla", "*.h"))):
        if "`%s`" % ("nabla/" + os.path.basename(h)) not in doc:
            fail("docs/api.md has no section for nabla/%s" % os.path.basename(h))
    print("ok: %d public functions, all in docs/api.md" % len(funcs))


if __name__ == "__main__":
    main()

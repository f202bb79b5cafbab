#!/usr/bin/env python3
"""Source sizes against their limits (CTest libfsdp_sizes), as a ratchet.

    python3 cmake/check_sizes.py <source dir> [--exceptions FILE] [--list]
    python3 cmake/check_sizes.py --self-test

Limits (docs/testing.md#sizes):
  - a file of libfsdp/ (.h, .cpp): at most 600 lines;
  - a function in libfsdp/: at most 100 lines;
  - a function in tools/, mpi_tests/, reference/, models/, examples/, h5/: at most
    150 lines.

A function's length is its lines from the one holding its name to the one
holding its closing brace, both included. Functions are found by a scanner
that matches braces outside comments, string and character literals and
preprocessor lines, and counts the bodies opened at namespace or class scope
(free functions, member functions defined in or outside their class, test
cases); lambdas and local classes count toward the function around them.

The exceptions file (default cmake/size-exceptions.txt) lists today's
offenders with their size:
    file <path> <lines>
    function <path> <name> <lines>
An offender it does not list fails, and so does a listed one that grew; a
listed one now within its limit, or no longer found, is reported so that its
line can be removed. --list prints every offender in the exceptions file's
format (to write it anew); --self-test checks the scanner on tricky syntax and
the verdicts on a small tree. Exit status: 0 pass, 1 fail, 2 usage or a file
the scanner cannot read (unbalanced braces).
"""
import os
import re
import sys

FILE_LIMIT = 600
LIB_FUNCTION_LIMIT = 100
OTHER_FUNCTION_LIMIT = 150
LIB_DIRS = ("libfsdp",)
OTHER_DIRS = ("tools", "mpi_tests", "reference", "models", "examples", "h5")
EXTENSIONS = (".h", ".cpp")


class ScanError(Exception):
    pass


def strip_code(text):
    """The text with comments, literals and preprocessor lines blanked
    (newlines kept, so line numbers stay)."""
    out = []
    i, n = 0, len(text)
    line_start = True  # only whitespace so far on this line
    while i < n:
        c = text[i]
        if c == "\n":
            out.append(c)
            line_start = True
            i += 1
            continue
        if line_start and c == "#":
            # a preprocessor line, with its continuations
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                if text.startswith("/*", i):
                    end = text.find("*/", i + 2)
                    end = n if end < 0 else end + 2
                    out.append(re.sub(r"[^\n]", " ", text[i:end]))
                    i = end
                    continue
                out.append(" ")
                i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise ScanError("unterminated comment")
            end += 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
            continue
        m = re.match(r'(?:u8|u|U|L)?R"([^ ()\\\t\n]{0,16})\(', text[i:i + 24])
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = ")" + m.group(1) + '"'
            end = text.find(close, i + m.end())
            if end < 0:
                raise ScanError("unterminated raw string")
            end += len(close)
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:end]))
            i = end
            continue
        if c == '"' or (c == "'" and not digit_separator(text, i)):
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    raise ScanError("newline in a literal")
                j += 1
            if j >= n:
                raise ScanError("unterminated literal")
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def digit_separator(text, i):
    """Whether the ' at i separates digits (1'000'000, 0xFF'FF)."""
    j = i - 1
    while j >= 0 and (text[j].isalnum() or text[j] in "'."):
        j -= 1
    return j + 1 < i and text[j + 1].isdigit()


def matching(code, open_at):
    """Index of the brace closing the one at open_at."""
    depth = 0
    for m in re.compile(r"[{}]").finditer(code, open_at):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return m.start()
    raise ScanError("unbalanced braces")


def top_level(head):
    """head with every bracketed part (), [], <...> of templates blanked,
    keeping the brackets themselves."""
    out, depth = [], 0
    for ch in head:
        if ch in "([":
            out.append(ch if depth == 0 else " ")
            depth += 1
            continue
        if ch in ")]":
            depth -= 1
            out.append(ch if depth == 0 else " ")
            continue
        out.append(ch if depth == 0 else " ")
    return "".join(out)


def paren_depth(head):
    return head.count("(") + head.count("[") - head.count(")") - head.count("]")


def strip_template_prefix(head):
    head = head.lstrip()
    while head.startswith("template"):
        k = head.find("<")
        if k < 0:
            return head
        depth = 0
        for j in range(k, len(head)):
            if head[j] == "<":
                depth += 1
            elif head[j] == ">":
                depth -= 1
                if depth == 0:
                    head = head[j + 1:].lstrip()
                    break
        else:
            return head
    return head


NAME_RE = re.compile(r"((?:[A-Za-z_~][\w]*\s*(?:<[^(){};]*>)?\s*::\s*)*"
                     r"(?:operator\s*(?:\(\s*\)|[^\s(]+)|~?[A-Za-z_]\w*))\s*\($")
NOT_NAMES = {"alignas", "decltype", "noexcept", "__attribute__", "__declspec", "requires",
             "sizeof", "alignof", "static_assert", "throw"}
INIT_COLON = re.compile(r"\)[^(]*?(?<!:):(?!:)")  # `) ... :` not `::`


def function_name(head):
    """(qualified name, its offset in head) of the function head declares:
    the name before the last parameter list (before a constructor's member
    initializer list, if any); None when head declares no function."""
    flat = top_level(head)
    m_init = INIT_COLON.search(flat)
    limit = m_init.end() if m_init else len(flat)
    best = None
    for m in re.finditer(r"\(", flat[:limit]):
        m2 = NAME_RE.search(head[:m.end()].replace("\n", " "))
        if not m2:
            continue
        name = re.sub(r"\s+", "", m2.group(1))
        if name.split("::")[-1] in NOT_NAMES:
            continue
        if re.fullmatch(r"[A-Z][A-Z0-9_]+", name):  # a macro: BOOST_AUTO_TEST_CASE(x)
            close = flat.find(")", m.start())
            args = re.sub(r"\s+", "", head[m.end():close].split(",")[0])
            name = f"{name}({args})" if args else name
        best = (name, m2.start(1))
    return best


def scan_functions(code):
    """(name, first line, last line) of each function body opened at
    namespace or class scope."""
    found = []
    line_of = LineIndex(code)
    braces = re.compile(r"[{};]")

    def scope(begin, end):
        head_start = begin
        i = begin
        while True:
            m = braces.search(code, i, end)
            if not m:
                return
            ch, at = m.group(), m.start()
            if ch == ";" or ch == "}":
                head_start = i = at + 1
                continue
            head = code[head_start:at]
            close = matching(code, at)
            if paren_depth(head) > 0:  # `f(T x = {})`: a braced argument, the head goes on
                i = close + 1
                continue
            kind = classify(head)
            if kind == "scope":
                scope(at + 1, close)
                head_start = i = close + 1
            elif kind == "member-init":  # a braced member initializer: the head goes on
                i = close + 1
            elif kind == "function":
                body = strip_template_prefix(head)
                name, offset = function_name(body)
                offset += len(head) - len(body)
                found.append((name, line_of(head_start + offset), line_of(close)))
                head_start = i = close + 1
            elif kind == "init":  # `= {...}` / `x{...}`: the declaration goes on to its ;
                i = close + 1
            else:  # enum, or a block we do not look into
                head_start = i = close + 1

    scope(0, len(code))
    return found


def classify(head):
    h = strip_template_prefix(head)
    flat = top_level(h)
    if re.match(r"\s*(inline\s+)?namespace\b", h) or re.match(r'\s*extern\s*"[^"]*"\s*$', h):
        return "scope"
    if re.match(r"\s*enum\b", h):
        return "skip"
    if re.match(r"\s*(\[\[[^\]]*\]\]\s*)?(class|struct|union)\b", h) and \
            "(" not in flat.split(":")[0]:
        return "init" if "=" in flat else "scope"
    if "(" not in flat:
        return "init"  # `Foo x{...}`, `T x[] = {`
    # a constructor's member initializer list: `) : a_(x), b_{` opens b_'s braces
    m_init = INIT_COLON.search(flat)
    if m_init and re.search(r"[\w>]\s*$", flat):
        return "member-init"
    before_call = re.sub(r"operator\s*[^\s(]*", "operator", flat.split("(")[0])
    if re.search(r"(?<![=!<>])=(?!=)", before_call):
        return "init"  # `auto f = [](...) {...};`
    if function_name(h) is None:
        return "skip"
    return "function"


class LineIndex:
    def __init__(self, code):
        self.starts = [0] + [m.end() for m in re.finditer("\n", code)]

    def __call__(self, pos):
        import bisect
        return bisect.bisect_right(self.starts, pos)


def sources(root):
    for top in LIB_DIRS + OTHER_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for f in sorted(filenames):
                if f.endswith(EXTENSIONS):
                    path = os.path.join(dirpath, f)
                    yield os.path.relpath(path, root).replace(os.sep, "/"), top


def measure(root):
    """Every offender: {(kind, path, name): (lines, limit)}; and counts."""
    offenders = {}
    n_files = n_functions = 0
    for rel, top in sources(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        n_files += 1
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if top in LIB_DIRS and lines > FILE_LIMIT:
            offenders[("file", rel, "")] = (lines, FILE_LIMIT)
        try:
            functions = scan_functions(strip_code(text))
        except ScanError as e:
            raise ScanError(f"{rel}: {e}") from None
        limit = LIB_FUNCTION_LIMIT if top in LIB_DIRS else OTHER_FUNCTION_LIMIT
        for name, first, last in functions:
            n_functions += 1
            length = last - first + 1
            key = ("function", rel, name)
            if length > limit and length > offenders.get(key, (0, 0))[0]:
                offenders[key] = (length, limit)
    return offenders, n_files, n_functions


def read_exceptions(path):
    allowed = {}
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if words[0] == "file" and len(words) == 3 and words[2].isdigit():
                allowed[("file", words[1], "")] = int(words[2])
            elif words[0] == "function" and len(words) == 4 and words[3].isdigit():
                allowed[("function", words[1], words[2])] = int(words[3])
            else:
                raise ValueError(f"{path}:{number}: expected 'file <path> <lines>' or "
                                 f"'function <path> <name> <lines>'")
    return allowed


def entry(key, lines):
    kind, path, name = key
    return f"{kind} {path} {name} {lines}" if name else f"{kind} {path} {lines}"


SELF_TEST_SOURCE = r"""// comment with { braces {{ and a "quote
#define BLOCK(x) { x }
namespace a::b {
struct S {
  S(int v) : v_{v}, w_(v) {
    v_ += 1;
  }
  [[nodiscard]] int get() const noexcept { return v_; }
  int v_ = 0, w_ = 0;
};
void with_default(std::vector<int> v = {}) {
  const char* s = "} not a brace {";
  const char c = '}';
  const int n = 1'000'000;
  auto r = R"x( } )" { )x";
  /* } */
}
const int table[] = {1, 2, 3};
}  // namespace a::b
template <typename T, typename = decltype(T{})>
T make() {
  return T{};
}
BOOST_AUTO_TEST_SUITE(suite)
BOOST_AUTO_TEST_CASE(a_case, *utf::timeout(5)) {
  [] { return 1; }();
}
BOOST_AUTO_TEST_SUITE_END()
"""
SELF_TEST_WANT = [("S", 5, 7), ("get", 8, 8), ("with_default", 11, 17), ("make", 21, 23),
                  ("BOOST_AUTO_TEST_CASE(a_case)", 25, 27)]


def self_test():
    """The scanner on tricky syntax, and the ratchet's verdicts on a small tree."""
    import tempfile
    got = [tuple(f) for f in scan_functions(strip_code(SELF_TEST_SOURCE))]
    if got != SELF_TEST_WANT:
        print(f"size check self-test: FAIL: scanned {got}, want {SELF_TEST_WANT}")
        return 1
    print(f"size check self-test: ok: the scanner finds {len(got)} functions with their extents")

    def tree(root, body_lines, file_lines):
        os.makedirs(os.path.join(root, "libfsdp", "src"), exist_ok=True)
        os.makedirs(os.path.join(root, "tools"), exist_ok=True)
        with open(os.path.join(root, "libfsdp", "src", "big.cpp"), "w") as fh:
            fh.write("void big() {\n" + "  ;\n" * (body_lines - 2) + "}\n")
            fh.write("//\n" * (file_lines - body_lines))
        with open(os.path.join(root, "tools", "t.cpp"), "w") as fh:
            fh.write("int tool(int x) {\n" + "  x++;\n" * 147 + "  return x;\n}\n")
    cases = [  # (function lines, file lines, exceptions, want status, want in output)
        (101, 601, "", 1, "libfsdp/src/big.cpp big: 101 lines, over the limit of 100"),
        (101, 601, "", 1, "libfsdp/src/big.cpp: 601 lines, over the limit of 600"),
        (102, 620, "function libfsdp/src/big.cpp big 101\nfile libfsdp/src/big.cpp 620\n", 1,
         "big: 102 lines, grew from its listed 101"),
        (101, 610, "function libfsdp/src/big.cpp big 120\nfile libfsdp/src/big.cpp 610\n", 0,
         "lower its line to 'function libfsdp/src/big.cpp big 101'"),
        (100, 600, "function libfsdp/src/big.cpp big 120\n", 0,
         "big: now within its limit (or gone): remove"),
    ]
    import contextlib
    import io
    for n, (body, lines, allow, want_rc, want_text) in enumerate(cases):
        with tempfile.TemporaryDirectory() as root:
            tree(root, body, lines)
            allow_path = os.path.join(root, "exceptions.txt")
            with open(allow_path, "w") as fh:
                fh.write(allow)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = main([root, "--exceptions", allow_path])
            if rc != want_rc or want_text not in out.getvalue():
                print(f"size check self-test: FAIL: case {n}: exit {rc} (want {want_rc}), "
                      f"output lacks '{want_text}':\n{out.getvalue()}")
                return 1
            print(f"size check self-test: ok: case {n}: exit {rc}, '{want_text}'")
    return 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    args = [a for a in argv if not a.startswith("--")]
    if len(args) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    exceptions = os.path.join(args[0], "cmake", "size-exceptions.txt")
    if "--exceptions" in argv:
        exceptions = argv[argv.index("--exceptions") + 1]
        args.remove(exceptions)
    root = args[0]
    try:
        offenders, n_files, n_functions = measure(root)
    except (ScanError, OSError) as e:
        print(f"size check: cannot scan {e}")
        return 2
    if "--list" in argv:
        for key in sorted(offenders):
            print(entry(key, offenders[key][0]))
        return 0
    try:
        allowed = read_exceptions(exceptions)
    except (ValueError, OSError) as e:
        print(f"size check: {e}")
        return 2

    failures, notes = [], []
    for key in sorted(offenders):
        lines, limit = offenders[key]
        what = f"{key[1]}" + (f" {key[2]}" if key[2] else "")
        if key not in allowed:
            failures.append(f"{what}: {lines} lines, over the limit of {limit} "
                            f"(split it; it is not in {os.path.basename(exceptions)})")
        elif lines > allowed[key]:
            failures.append(f"{what}: {lines} lines, grew from its listed {allowed[key]} "
                            f"(limit {limit})")
        elif lines < allowed[key]:
            notes.append(f"{what}: {lines} lines, down from its listed {allowed[key]}: "
                         f"lower its line to '{entry(key, lines)}'")
    for key in sorted(allowed):
        if key not in offenders:
            what = f"{key[1]}" + (f" {key[2]}" if key[2] else "")
            notes.append(f"{what}: now within its limit (or gone): remove "
                         f"'{entry(key, allowed[key])}' from {os.path.basename(exceptions)}")
    for note in notes:
        print(f"size check: note: {note}")
    for failure in failures:
        print(f"size check: FAIL: {failure}")
    print(f"size check: {n_files} files, {n_functions} functions; {len(offenders)} over their "
          f"limits, {len(allowed)} listed exceptions; {len(failures)} failure(s)")
    if failures:
        return 1
    print(f"size check: pass (files <= {FILE_LIMIT} lines in libfsdp/, functions <= "
          f"{LIB_FUNCTION_LIMIT} in libfsdp/ and <= {OTHER_FUNCTION_LIMIT} elsewhere, "
          f"but for the listed exceptions)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

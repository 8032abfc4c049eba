"""A large client body parsed a bounded piece at a time, for ``kvpool proxy``.

``json.loads`` (and its scanner's ``scan_once``) holds the GIL for a whole value: a 33 MiB prompt
string took one call 30 ms to scan and the depth check's regular expression over the body's text
another 80 ms, so a thread parsing it still held the proxy's event loop for 0.1-0.3 s. Here
:func:`parse_big` walks the body itself (containers with an explicit stack, so the nesting is
bounded as it goes and no regex runs over the whole text) and hands each C call a bounded piece:
a long string is decoded :data:`PIECE` characters at a time (cut only where no escape sequence or
surrogate pair can straddle the cut), a long flat array of numbers is parsed a piece at a time
cut at commas, and everything else (keys, numbers, short strings) is small. The GIL is taken back
between pieces, so a thread running it leaves the event loop free. What is left are copies (the
body's decoding, a long string's pieces joined: ~15 ms per 33 MiB each, bounded by
``max_request_bytes``). Called by
:func:`kvpool.connectors.openai_api.parse_raw_body` for bodies over 1 MiB (in a thread).

The result is ``json.loads``'s for every body it accepts (long arrays of token ids as
``array('I')``: see :func:`parse_big`); it refuses what ``json.loads`` refuses
(with its own one-line reason), and bodies nested deeper than ``max_depth``.
"""

from __future__ import annotations

import json
import re
from array import array
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

__all__ = ["PIECE", "BodyTooDeep", "NotAnObject", "jsonable", "loads_ids", "parse_big"]

#: Characters handed to one C call (a string's piece, a flat array's piece): about a millisecond.
PIECE = 1 << 18

_WS = re.compile(r"[ \t\n\r]*")
#: A string's characters and complete two-character escapes, up to its closing quote.
_STR_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
#: Characters a string piece must not end on: inside ``\uXXXX`` or just after a backslash (a
#: piece ending on anything else ends on a whole escape and no surrogate pair is cut).
_NO_CUT = "0123456789abcdefABCDEFu\\"
_scan_once = json.JSONDecoder().scan_once
#: A character that is not in a list of non-negative ints.
_NOT_ID = re.compile(r"[^0-9,\s]")


class BodyTooDeep(ValueError):
    """The body nests deeper than the depth given to :func:`parse_big`."""


class NotAnObject(ValueError):
    """The body given to :func:`parse_big` does not start with ``{``."""


def _scan_string(text: str, i: int) -> tuple[str, int]:
    """The JSON string starting at ``text[i] == '"'`` and the index past it, scanned and decoded
    at most :data:`PIECE` characters per C call."""
    a = i + 1
    parts: list[str] = []
    while True:
        c = a + PIECE
        p = _STR_BODY.match(text, a, c).end()
        if p < c and p < len(text):  # its closing quote (or an error) is within this piece
            s, end = scanstring(text, a)
            if not parts:
                return s, end
            parts.append(s)
            return "".join(parts), end
        q = a + len(text[a:p].rstrip(_NO_CUT))
        if q == a:  # a piece of hex digits and escapes only: scan the rest at once
            s, end = scanstring(text, a)
            parts.append(s)
            return "".join(parts), end
        parts.append(scanstring(text[a:q] + '"', 0)[0])
        a = q


def _has_any(text: str, chars: str, a: int, b: int) -> bool:
    """Whether ``text[a:b]`` holds one of ``chars`` (a piece per search)."""
    for c in chars:
        for s in range(a, b, PIECE * 4):
            if text.find(c, s, min(s + PIECE * 4, b)) >= 0:
                return True
    return False


def _flat_numbers(text: str, i: int) -> tuple[list[Any] | array[int], int] | None:
    """The long array of numbers (no strings, arrays or objects) at ``text[i] == '['`` parsed a
    piece (cut at commas) per C call, and the index past it; None when it is not one. Token ids
    (ints in [0, 2**32) only) come as an ``array('I')``: a list of millions of ints takes tens
    of ms to free (one reference at a time, the GIL held) and is walked by the cyclic GC."""
    end = text.find("]", i)
    if end - i <= PIECE or _has_any(text, '"[{', i + 1, end):
        return None
    ids: array[int] | None = array("I")
    out: list[Any] = []
    a = i + 1
    while True:
        b = text.find(",", min(a + PIECE, end), end)
        b = end if b < 0 else b
        part = json.loads("[" + text[a:b] + "]")
        if not part:  # "[1,]", "[1,,2]"
            raise ValueError(f"expected a value at char {b}")
        if ids is not None and _NOT_ID.search(text, a, b) is None and max(part) < 1 << 32:
            ids.extend(part)
        else:
            if ids is not None:  # not token ids after all (rare): a list, like json.loads
                out, ids = ids.tolist(), None
            out += part
        if b == end:
            return (out if ids is None else ids), end + 1
        a = b + 1


def parse_big(text: str, max_depth: int) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """``json.loads(text)`` of a JSON object, with each top-level value's span in ``text`` (a key
    that repeats: its last value's, the one ``json.loads`` keeps), a bounded piece per C call;
    an array of over :data:`PIECE` characters of ints in [0, 2**32) (token ids) comes as an
    ``array('I')`` of them. Raises ValueError with a one-line reason for anything ``json.loads``
    refuses or that is not an object (:class:`NotAnObject`), :class:`BodyTooDeep` past
    ``max_depth`` levels (the top-level object is one)."""
    ws = _WS.match
    i = ws(text, 0).end()
    if not text.startswith("{", i):
        raise NotAnObject("request body must be a JSON object")
    root: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    # parents: (container, is object, key in it, start of the child's text)
    stack: list[tuple[Any, bool, Any, int]] = []
    cur: Any = root
    is_obj = True
    key: Any = None
    start = i
    i = ws(text, i + 1).end()
    value: Any = None
    if text.startswith("}", i):
        if ws(text, i + 1).end() != len(text):
            raise ValueError(f"extra data at char {i + 1}")
        return root, spans
    while True:
        # a member of cur starts at i
        if is_obj:
            if not text.startswith('"', i):
                raise ValueError(f"expected a key at char {i}")
            key, i = _scan_string(text, i)
            i = ws(text, i).end()
            if not text.startswith(":", i):
                raise ValueError(f"expected ':' at char {i}")
            i = ws(text, i + 1).end()
        start = i
        ch = text[i : i + 1]
        if ch in ("{", "["):
            flat = _flat_numbers(text, i) if ch == "[" else None
            if flat is not None:
                value, i = flat
            else:
                if len(stack) + 2 > max_depth:
                    raise BodyTooDeep(f"request body nests deeper than {max_depth} levels")
                stack.append((cur, is_obj, key, start))
                cur, is_obj = ({}, True) if ch == "{" else ([], False)
                i = ws(text, i + 1).end()
                if not text.startswith("}" if is_obj else "]", i):
                    continue  # its first member
                i += 1
                value = cur
                cur, is_obj, key, start = stack.pop()
        elif ch == '"':
            value, i = _scan_string(text, i)
        else:
            try:
                value, i = _scan_once(text, i)
            except StopIteration:
                raise ValueError(f"expected a value at char {i}") from None
        while True:  # store value in cur, then its separator (closing containers)
            if is_obj:
                if cur is root:
                    spans[key] = (start, i)
                cur[key] = value
            else:
                cur.append(value)
            i = ws(text, i).end()
            sep = text[i : i + 1]
            if sep == ",":
                i = ws(text, i + 1).end()
                break
            if sep != ("}" if is_obj else "]"):
                raise ValueError(f"expected ',' or '{'}' if is_obj else ']'}' at char {i}")
            i += 1
            if not stack:
                if ws(text, i).end() != len(text):
                    raise ValueError(f"extra data at char {i}")
                return root, spans
            value = cur
            cur, is_obj, key, start = stack.pop()


def loads_ids(data: bytes) -> dict[str, Any] | None:
    """``json.loads(data)`` of a backend's answer (a ``/tokenize`` or prefill answer), a bounded
    piece per C call, its long arrays of token ids as ``array('I')`` (:func:`parse_big`, no depth
    limit: it keeps its own stack): an invalid one raises its one-line ValueError (``json.loads``
    over the whole text held the GIL as long). An answer that does not start as an object is None,
    unparsed: every caller wants an object, and ``json.loads`` of a long array or string held the
    GIL for all of it (0.1 s and more, the event loop stalled meanwhile). Called in a thread by the
    proxy."""
    try:
        return parse_big(data.decode("utf-8"), 1 << 30)[0]
    except NotAnObject:
        return None
    except UnicodeDecodeError:
        raise ValueError("answer is not UTF-8") from None


def jsonable(value: Any) -> Any:
    """``default`` of ``json.dumps`` for the values :func:`parse_big` makes: an ``array`` as a
    list (TypeError for anything else, as without it)."""
    if isinstance(value, array):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

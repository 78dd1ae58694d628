r"""Where the final answer is in a response: the text after the thinking, then the answer in it.

Precedence (docs/data.md, "Extraction"):
0. the thinking: only what follows the last `</think>` is graded; a response whose `<think>` never closes has
   no answer (`grade_thinking=True` grades the whole response);
1. boxes: the last balanced `\boxed{...}` (else `\fbox{...}`; an unclosed last box is no box), together with the
   boxes just before it when only joiners separate them (`,`, `;`, `and`, `\quad`, `\text{and}`, `$`, spaces, a
   label such as `y =`): `\boxed{2} and \boxed{-3}` is `2, -3`; a word such as `or`, `not` or `wait` ends the
   run, and repeats of one answer count once. A statement of the final answer after the last box ("the final
   answer is X", "the answer is X", a line "Answer: X") overrides it;
2. the latest answer phrase ("final answer / answer / therefore / thus ... is | are | be | : | =", the verb outside
   any maths, not a line that checks an answer) that states maths: the maths right after it, ending where the
   maths ends (`42 because ...` is `42`), else the maths before its verb (`Thus, 5 is the answer`); an answer
   statement with maths later in its sentence counts too; a phrase of words only is a last resort;
3. the last line when it is all maths (`x^2+2x+1`), else the last math span (`$...$`, `\(...\)`, `\[...\]`,
   `$$...$$`) taken whole, or a bare number after it (integer, decimal, `1,234`, `1 234`, `.5`, `a/b`,
   `\frac{a}{b}`, a mixed number `4 4/9`, a ratio `3:4`). An answer over MAX_ANSWER_CHARS is no answer.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from logra_rl.rewards.graders import final_text

BOX_COMMANDS = ("\\boxed", "\\fbox")
MAX_ANSWER_CHARS = 1000

_KEYWORD = re.compile(r"\b(?:final answer|answers?|therefore|thus)\b", re.IGNORECASE)
# A statement of the final answer, as opposed to "we may check our answer: ...".
_STATEMENT = re.compile(
    r"\bfinal answer\b|\bthe answer(?=\s+is\b)|^[ \t*#]*answer\b(?=[ \t*]*:)", re.IGNORECASE | re.MULTILINE
)
_PHRASE_CHAR = r"(?:(?!<\||</?[a-zA-Z]+>)[^\n])"  # a line's characters up to a `<|marker|>` or a <tag>
_PHRASE = re.compile(
    rf"(?P<gap>{_PHRASE_CHAR}{{0,40}}?)(?:\b(?:is|are|was|be|equals)\b:?|:|=)[ \t]*(?P<tail>{_PHRASE_CHAR}+)",
    re.IGNORECASE,
)
# Words that may open a stated answer without being it ("the answer is actually 4").
_FILLER = re.compile(r"(?:(?:actually|therefore|then|still|indeed|now|clearly|simply|just|exactly)\b[ \t,]*)+", re.I)
_NEGATION = re.compile(r"\s*not\b", re.IGNORECASE)
# A phrase that checks an answer rather than stating it ("we may check our answer: 17 * 44 = 748").
_CHECKING = re.compile(r"\b(?:check|checking|verify|verifying|verification|confirm|confirming|test|testing)\b", re.I)
_SENTENCE_END = re.compile(r"\.(?!\d)|,\s+(?=[a-z]{2,}\b)")  # "Evelyn, who won." -> "Evelyn"
_FRACTION = r"\\[dt]?frac\{\d+\}\{\d+\}"
_NUMBER_FORMS = [
    r"\d+ \d+/\d+(?![\d/])",  # a mixed number: 4 4/9
    r"\d+ ?" + _FRACTION,  # 918\frac{1}{2}
    _FRACTION,
    r"\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])",  # 1,234.5
    r"\d{1,3}(?: \d{3})+(?![\d/])",  # 1 234
    r"\d+:\d+(?::\d+)?(?!\d)",  # a ratio or a time: 3:4, 2:30
    r"\d+(?:\.\d+)?(?:/\d+)?",
    r"\.\d+",
]
_NUMBER = re.compile(r"(?<![A-Za-z0-9.])-?(?:" + "|".join(_NUMBER_FORMS) + ")")
# Math spans; content never holds a `$`, and an inline span does not close before a digit ("$5 and $10").
_MATH_SPAN = re.compile(
    r"\$\$(?P<display>.+?)\$\$|(?<![\\$])\$(?!\s*\$)(?P<inline>(?:\\.|[^$\\])+?)\$(?!\d)"
    r"|\\\((?P<paren>(?:(?!\\[()]).)+?)\\\)|\\\[(?P<bracket>(?:(?!\\[\[\]]).)+?)\\\]",  # never past another opener
    re.DOTALL,
)
# What may stand between two boxes that together form one answer, and a box's label (`y_1 = \boxed{...}`).
_JOINERS = re.compile(
    r"(?:\s|\$|\\[\[\]()]|\\q?quad(?![a-zA-Z])|\\[,;:! ]|\\text\{\s*(?:and|,)?\s*\}|\\\\|&|,|;|\band\b)*"
)
_LABEL = re.compile(r"(?<![\w\\])(?P<label>[a-zA-Z](?:_\{?\w+\}?)?)\s*=\s*$")
# One token of maths in running text: spans, commands, numbers, words, letters, brackets, symbols.
_TOKEN = re.compile(
    r"(?P<space>\s+)|(?P<span>(?<!\\)\$(?!\s*\$)(?:\\.|[^$\\])+?\$(?!\d)|\\\(.+?\\\)|\\\[.+?\\\])"
    r"|(?P<command>\\(?:[a-zA-Z]+|[,;:! {}\\]))"
    r"|(?P<number>(?:" + _NUMBER_FORMS[0] + r"|\d+(?:\.\d+)?))|(?P<word>[a-zA-Z]{2,})|(?P<letter>[a-zA-Z])"
    r"|(?P<open>[({\[])|(?P<close>[)}\]])"
    r"|(?P<stop>\.(?!\d)|,(?=\s+(?!and\b)[a-zA-Z]{2,}))|(?P<symbol>[-+*/^_=<>|!',;:&%°√π∞·×÷−≤≥≠]|\.)"
)
_AND = re.compile(r",?\s*\band\b\s*")
_MATH_WORDS = frozenset({"sqrt", "pi", "infty", "inf", "infinity", "mod", "log", "ln", "sin", "cos", "tan", "exp"})
_TRAILING = " \t,;:*"
_END_PUNCTUATION = re.compile(r"(?<!\.)[.,;]\s*$")  # a sentence's full stop, not an ellipsis


class Answer(NamedTuple):
    """The extracted answer, and for an answer phrase its whole sentence (`A KING IS HE` against `A`): a reference
    answer written out verbatim there is correct even where the maths ends sooner."""

    text: str
    sentence: str | None = None


def extract_answer(response: str, grade_thinking: bool = False) -> str | None:
    """The final answer in `response` (module docstring for the order), or None when there is none."""
    answer = find_answer(response, grade_thinking)
    return answer.text if answer else None


def find_answer(response: str, grade_thinking: bool = False) -> Answer | None:
    """`extract_answer` with the answer phrase's sentence, when the answer came from one."""
    text = final_text(response, grade_thinking)
    if not text:
        return None
    answer = _find(text)
    return answer if answer is not None and len(answer.text) <= MAX_ANSWER_CHARS else None


def _find(text: str) -> Answer | None:
    boxed = _boxed_answer(text)
    if boxed is not None:
        return Answer(boxed)
    masked = _masked(text)
    weaker: list[tuple[Answer, bool]] = []  # phrases that state no maths of their own (latest first)
    for keyword in reversed(list(_KEYWORD.finditer(masked))):
        answer, stated = _phrase_answer(text, masked, keyword)
        from_answer_keyword = "answer" in keyword.group().lower()
        if answer and (stated or (from_answer_keyword and answer.text != answer.sentence)):
            return answer  # maths right after it, or an answer statement with maths in its sentence
        if answer:
            weaker.append((answer, from_answer_keyword))
    # Maths in a "thus ..." sentence, then an answer stated in words ("The answer is Evelyn"), then the last
    # maths; a "thus ..." sentence of words only comes last.
    for answer, _ in weaker:
        if answer.text != answer.sentence:
            return answer
    for answer, from_answer_keyword in weaker:
        if from_answer_keyword:
            return answer
    last_line = text.rsplit("\n", 1)[-1]
    maths, end = _maths_prefix(last_line)
    if maths and not last_line[end:].strip(_TRAILING):
        return Answer(maths)
    last = _last_math(text)
    if last:
        return Answer(last)
    return weaker[0][0] if weaker else None


def boxes(text: str, command: str) -> list[tuple[int, int, str | None]]:
    r"""Every outermost `command{...}` as (start, end, content); an unclosed one (content None) ends the list."""
    found, position = [], 0
    while (start := text.find(command + "{", position)) >= 0:
        depth, content_start = 0, start + len(command) + 1
        for i in range(content_start - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append((start, i + 1, text[content_start:i]))
                position = i + 1
                break
        else:
            found.append((start, len(text), None))
            break
    return found


def _boxed_answer(text: str) -> str | None:
    for command in BOX_COMMANDS:
        found = boxes(text, command)
        if not found:
            continue
        if found[-1][2] is None:  # the last box is cut off mid-answer: no box
            return None
        # An explicit statement after the last box wins: "... \boxed{12} apples per crate. The answer is 60."
        masked = _masked(text) if _STATEMENT.search(text, found[-1][1]) else ""
        for keyword in reversed(list(_STATEMENT.finditer(masked, found[-1][1]))):
            answer, stated = _phrase_answer(text, masked, keyword)
            if answer and stated:
                return answer.text
        return _joined(text, found)
    return None


def _joined(text: str, found: list[tuple[int, int, str]]) -> str:
    """The last box with the boxes before it that only joiners (and labels) separate from it, as one answer."""
    labels = [_LABEL.search(text, max(0, start - 24), start) for start, _, _ in found]
    first = len(found) - 1
    while first > 0:
        gap_end = labels[first].start() if labels[first] else found[first][0]
        if not _JOINERS.fullmatch(text, found[first - 1][1], gap_end):
            break
        first -= 1
    run = range(first, len(found))
    if len(run) > 1 and any(labels[i] for i in run):  # `x = \boxed{2}, y = \boxed{3}` is `x = 2, y = 3`
        parts = [f"{labels[i]['label']} = {found[i][2].strip()}" if labels[i] else found[i][2].strip() for i in run]
    else:
        parts = [found[i][2].strip() for i in run]
    return ", ".join(dict.fromkeys(parts))  # one answer boxed twice is one answer


def _phrase_answer(text: str, masked: str, keyword: re.Match) -> tuple[Answer | None, bool]:
    """What the answer phrase at `keyword` says, and whether it states maths of its own: the leading maths of
    its tail, else the maths between the keyword and its verb (`Thus, 5 is the answer`); failing both, the
    last maths of its sentence or its words. `masked` is `text` with math spans blanked, so a phrase's verb is
    never an `=` inside the maths (`Therefore $x^2 = 9$, so $x = 3$` has no phrase)."""
    line_start = masked.rfind("\n", 0, keyword.start()) + 1
    if _CHECKING.search(masked, line_start, keyword.start()):  # "let me check the answer: 42 / 6 = 7"
        return None, False
    phrase = _PHRASE.match(masked, keyword.end())
    if phrase is None:
        return None, False
    tail = text[phrase.start("tail") : phrase.end("tail")]
    if _NEGATION.match(tail):  # "the answer is not 4" says what the answer is not
        return None, False
    filler = _FILLER.match(tail)
    sentence = _SENTENCE_END.split(tail, maxsplit=1)[0].strip(" \t*") or None
    maths, _ = _maths_prefix(tail[filler.end() if filler else 0 :])
    if maths:
        return Answer(maths, sentence), True
    gap = _last_math(text[phrase.start("gap") : phrase.end("gap")])
    if gap:
        return Answer(gap, sentence), True
    if sentence is None:
        return None, False
    return Answer(_last_math(sentence) or sentence, sentence), False


def _masked(text: str) -> str:
    """`text` with every math span's content replaced by `#` (same length, delimiters kept)."""
    pieces, position = [], 0
    for span in _MATH_SPAN.finditer(text):
        group = next(name for name, value in span.groupdict().items() if value is not None)
        pieces += [text[position : span.start(group)], "#" * (span.end(group) - span.start(group))]
        position = span.end(group)
    return "".join(pieces) + text[position:]


def _maths_prefix(tail: str) -> tuple[str | None, int]:
    """The maths at the start of `tail`, up to the first word of prose (`42 because ...` -> `42`), and where it
    ends; (None, 0) when `tail` does not start with maths."""
    start = len(tail) - len(tail.lstrip(" \t*"))
    position, end, depth, previous = start, start, 0, None
    while position < len(tail):
        token = _TOKEN.match(tail, position)
        kind = token.lastgroup if token else None
        if kind == "span" and end == start:  # the tail starts with maths: it and the spans joined to it
            joined = _last_math(tail[: _joined_spans_end(tail, token.end())])
            return joined, _joined_spans_end(tail, token.end())
        if depth > 0 and token is not None:
            depth += {"open": 1, "close": -1}.get(kind, 0)
        elif kind == "word" and token.group().lower() == "and" and _starts_maths(tail, token.end()):
            kind = "symbol"  # "2 and 3": a joiner between two pieces of maths
        elif kind in (None, "stop", "span", "close") or (kind == "word" and not _math_word(token.group(), previous)):
            break  # prose, the end of a sentence, or a bracket opened before the tail
        elif kind == "open":
            depth += 1
        if kind != "space":
            end = token.end()
        previous, position = kind, token.end()
    maths = _AND.sub(", ", _END_PUNCTUATION.sub("", tail[start:end]).strip(_TRAILING))
    return (maths, end) if any(c.isalnum() or c == "\\" for c in maths) else (None, 0)


def _joined_spans_end(text: str, position: int) -> int:
    """Where the run of math spans that ends at `position` ends, following joiners (`$a$ and $b$`)."""
    while (span := _MATH_SPAN.search(text, position)) and _JOINERS.fullmatch(text, position, span.start()):
        position = span.end()
    return position


def _math_word(word: str, previous: str | None) -> bool:
    """A run of letters that is maths: a known function or constant, or glued to maths before it (`2xy`)."""
    return word.lower() in _MATH_WORDS or previous not in (None, "space")


def _starts_maths(tail: str, position: int) -> bool:
    token = _TOKEN.match(tail, position)
    while token is not None and token.lastgroup == "space":
        token = _TOKEN.match(tail, token.end())
    return token is not None and token.lastgroup in ("number", "letter", "command", "open", "span", "symbol")


def _span_content(span: re.Match) -> str:
    return _END_PUNCTUATION.sub("", next(g for g in span.groups() if g is not None).strip())


def _unwrap(span: str) -> str:
    """A math span's content: `$x$`, `$$x$$`, `\\(x\\)`, `\\[x\\]` -> `x` (without a full stop)."""
    return _END_PUNCTUATION.sub("", (span[2:-2] if span.startswith("\\") else span.strip("$")).strip())


def _last_math(text: str) -> str | None:
    """The last math span whole (with the spans before it that only joiners separate from it: `$x = 3$ and
    $y = -2$`), or the last bare number after it."""
    spans = list(_MATH_SPAN.finditer(text))
    numbers = _NUMBER.findall(text, spans[-1].end() if spans else 0)
    if numbers:
        return numbers[-1]
    if not spans:
        return None
    first = len(spans) - 1
    while first > 0 and _JOINERS.fullmatch(text, spans[first - 1].end(), spans[first].start()):
        first -= 1
    return ", ".join(dict.fromkeys(_span_content(span) for span in spans[first:]))

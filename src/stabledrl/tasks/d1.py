"""d1's GSM8K and MATH rewards (Zhao et al. 2025, dllm-reasoning/d1, diffu-grpo/reward_func.py
and math500_utils.py), re-implemented from its rules, warts included; each rule below names
the function of d1 it reproduces.

GSM8K, the sum of five terms (at most 4.0; TRL's GRPOTrainer adds d1's reward functions):
  `xml_count` (d1 count_xml, up to 0.5), `soft_format` 0.5, `strict_format` 0.5, 0.5 if the
  answer-tag text is all digits (int_reward_func), 2.0 if it equals the reference's text after
  "####" (correctness_reward_func). Exact string comparison: "72.0" or "1,000" is wrong.
MATH, the sum of two terms: 2.0 if the last box's content is equivalent to the reference
  solution's under `equivalent` (Hendrycks et al.'s string normalisation, d1 is_equiv), plus
  0.5 x (1 if "<answer>" appears, plus 1 if the answer text holds "\\x08oxed", else 0.5)
  (boxed_and_answer_tags_format_reward). d1 writes that last test as the Python literal
  "\\boxed" unescaped, which is a backspace followed by "oxed": it holds almost never, so the
  term is 0.75 with an answer tag and 0.25 without. Reproduced as d1 runs, not as it reads.
"""

from __future__ import annotations

import re

__all__ = ["GSM8K_PROMPT", "MATH_PROMPT", "answer_text", "xml_count", "soft_format", "strict_format",
           "gsm8k_terms", "last_box_d1", "normalise", "equivalent", "math_terms"]

# The format d1's system prompt asks for, in our words; the problem follows (`str.format` templates).
_FORMAT = "Reply in exactly this layout:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n\n"
GSM8K_PROMPT = _FORMAT + "{question}"
MATH_PROMPT = (_FORMAT + "Solve the problem step by step and put the final answer in \\boxed{{}}.\n\n{problem}")

_SOFT = re.compile(r"<reasoning>[^\n]*?</reasoning>\s*<answer>[^\n]*?</answer>")
# d1's strict pattern ends in "\n$" without MULTILINE: one more newline may close the text.
_STRICT = re.compile(r"<reasoning>\n[^\n]*\n</reasoning>\n<answer>\n[^\n]*\n</answer>\n\n?")


def answer_text(text: str) -> str:
    """What follows the last "<answer>" up to the next "</answer>", stripped; the whole text
    when there is no tag (d1 extract_xml_answer)."""
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def xml_count(text: str) -> float:
    """0.125 for each of "<reasoning>\\n", "\\n</reasoning>\\n", "\\n<answer>\\n" and "\\n</answer>"
    present exactly once, less 0.001 a character after the closing tag (d1 count_xml: the
    third term charges every character after the last "\\n</answer>\\n", the whole text when
    there is none; the fourth charges those after "\\n</answer>" less one)."""
    score = 0.0
    if text.count("<reasoning>\n") == 1:
        score += 0.125
    if text.count("\n</reasoning>\n") == 1:
        score += 0.125
    if text.count("\n<answer>\n") == 1:
        score += 0.125 - len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        score += 0.125 - (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return score


def soft_format(text: str) -> bool:
    """The text starts with <reasoning>...</reasoning>, whitespace, <answer>...</answer>, each
    pair on one line ('.' without DOTALL in d1's soft_format_reward_func)."""
    return _SOFT.match(text) is not None


def strict_format(text: str) -> bool:
    """The whole text is "<reasoning>\\nR\\n</reasoning>\\n<answer>\\nA\\n</answer>\\n" with R and A
    single lines, optionally one more newline (d1 strict_format_reward_func)."""
    return _STRICT.fullmatch(text) is not None


def gsm8k_terms(text: str, reference: str) -> dict[str, float]:
    """d1's five GSM8K reward terms of one completion; `reference` is the text after the
    reference solution's first "####", stripped (d1 extract_hash_answer)."""
    answer = answer_text(text)
    return {"xml_count": xml_count(text), "soft_format": 0.5 if soft_format(text) else 0.0,
            "strict_format": 0.5 if strict_format(text) else 0.0, "integer": 0.5 if answer.isdigit() else 0.0,
            "correct": 2.0 if answer == reference else 0.0}


def last_box_d1(text: str) -> str:
    """The content of the last box as d1 reads a completion (last_boxed_only_string, then
    remove_boxed, the completion itself where either fails): after "\\boxed " (with a space),
    up to the next "$"; else the last \\boxed (or \\fbox) with balanced braces, unwrapped only
    if it is a \\boxed{...}; without a box, the whole text."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return text
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                box = text[start:i + 1]
                return box[len("\\boxed{"):-1] if box.startswith("\\boxed{") else box
    return text  # unclosed: d1's remove_boxed fails on None and keeps the completion


def _fix_sqrt(s: str) -> str:
    parts = s.split("\\sqrt")
    # an empty piece (a trailing \sqrt) raises IndexError, as in d1
    return parts[0] + "".join("\\sqrt" + p if p[0] == "{" else "\\sqrt{" + p[0] + "}" + p[1:] for p in parts[1:])


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if p[0] == "{":  # an empty piece raises IndexError, as in d1
            out += p
        elif len(p) < 2:
            return s  # d1 gives up and keeps the string
        elif p[1] != "{":
            out += "{" + p[0] + "}{" + p[1] + "}" + p[2:]
        else:
            out += "{" + p[0] + "}" + p[1:]
    return out


def _fix_slash(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    a, b = int(parts[0]), int(parts[1])  # ValueError on a non-integer side, as in d1
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


_DROP = ("\n", "\\!")
_REPLACE = (("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""), ("\\right", ""),
            ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))


def normalise(s: str) -> str:
    """Hendrycks et al.'s answer normalisation in d1's order (math500_utils strip_string).
    Raises where d1's raises (then `equivalent` compares the raw strings)."""
    for old in _DROP:
        s = s.replace(old, "")
    for old, new in _REPLACE:
        s = s.replace(old, new)
    if "\\text{ " in s:  # units on the right; d1 asserts there is exactly one
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise ValueError("more than one '\\text{ '")
        s = parts[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    if "\\sqrt" in s:
        s = _fix_sqrt(s)
    s = _fix_fracs(s.replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def equivalent(pred: str, gold: str) -> bool:
    """Equal after `normalise`; equal as raw strings when normalising either raises (d1 is_equiv)."""
    try:
        return normalise(pred) == normalise(gold)
    except Exception:
        return pred == gold


def math_terms(text: str, solution: str) -> dict[str, float]:
    """d1's two MATH reward terms of one completion against the reference solution."""
    tagged = "<answer>" in text
    inner = text.split("<answer>")[1].split("</answer>")[0] if tagged else text
    boxed = 1.0 if "\x08oxed" in inner else 0.5  # d1's "\boxed" literal is a backspace + "oxed"
    return {"correct": 2.0 if equivalent(last_box_d1(text), last_box_d1(solution)) else 0.0,
            "format": 0.5 * ((1.0 if tagged else 0.0) + boxed)}

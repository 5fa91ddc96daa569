"""Execution-based score for the demo models: pass@1 of greedy completions of small unit-tested Python problems.

    python -m demo_build.exec_eval [--model demo/parent] [--max-new-tokens 128] [--batch-size 40] [--json FILE]

`PROBLEMS` are 40 short functions written for this repository (not taken from any benchmark), ordered roughly from
trivial to harder. Each prompt is a top-level `def` header line, a one-line docstring and a newline; the model's greedy
completion is cut like `demo_build.eval_demo` judges completions (up to the first column-0 line after the prompt, else
the last complete line; `cut_completion`), and the cut function plus the problem's assert lines run in a fresh
`python -I` subprocess (`run_problem`): temporary working directory, stdin closed, output discarded, sockets disabled,
CPU seconds, address space (1 GiB), file size and core dumps limited where `resource` exists, killed with its process
group at the timeout. A problem passes iff that process exits 0. Each problem carries a reference solution, which
tests/test_exec_eval.py runs (and checks that a `return None` body fails).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

from demo_build.eval_demo import complete, load
from reap_tools.generate import cut_completion

ROOT = Path(__file__).resolve().parents[1]

MEMORY_LIMIT = 1 << 30
FILE_LIMIT = 1 << 20
# Runs before the candidate: the completions are untrusted, and nothing they may do needs the network.
NO_NETWORK = (
    "import socket as _socket\n"
    "def _no_network(*args, **kwargs):\n"
    "    raise OSError('network disabled')\n"
    "_socket.socket = _socket.create_connection = _socket.socketpair = _no_network\n"
    "del _socket, _no_network\n"
)


class Problem(NamedTuple):
    name: str
    prompt: str  # header line + docstring line, each ending with a newline
    solution: str  # prompt + a reference body
    tests: str  # assert lines


def _problem(header: str, doc: str, body: str, *checks: str) -> Problem:
    prompt = f'{header}\n    """{doc}"""\n'
    name = header[len("def "):header.index("(")]
    return Problem(name, prompt, prompt + textwrap.indent(body, "    ") + "\n",
                   "".join(f"assert {c}, {c!r}\n" for c in checks))


PROBLEMS = (
    _problem("def add(a, b):", "Return the sum of a and b.", "return a + b",
             "add(2, 3) == 5", "add(-4, 4) == 0", "add(0.5, 0.25) == 0.75"),
    _problem("def square(x):", "Return x multiplied by itself.", "return x * x",
             "square(3) == 9", "square(-2) == 4", "square(0) == 0"),
    _problem("def is_even(n):", "Return True if the integer n is even, else False.", "return n % 2 == 0",
             "is_even(4) is True", "is_even(7) is False", "is_even(0) is True", "is_even(-3) is False"),
    _problem("def absolute(x):", "Return the absolute value of the number x.", "return -x if x < 0 else x",
             "absolute(-5) == 5", "absolute(3) == 3", "absolute(0) == 0"),
    _problem("def maximum(items):", "Return the largest element of the non-empty list items.", "return max(items)",
             "maximum([3, 9, 2]) == 9", "maximum([-7]) == -7", "maximum([-3, -1, -2]) == -1"),
    _problem("def minimum(items):", "Return the smallest element of the non-empty list items.", "return min(items)",
             "minimum([3, 9, 2]) == 2", "minimum([5]) == 5", "minimum([-3, -1, -2]) == -3"),
    _problem("def reverse_string(s):", "Return the string s reversed.", "return s[::-1]",
             "reverse_string('abc') == 'cba'", "reverse_string('') == ''", "reverse_string('racecar') == 'racecar'"),
    _problem("def last_element(items):", "Return the last element of the non-empty sequence items.",
             "return items[-1]",
             "last_element([1, 2, 3]) == 3", "last_element('xyz') == 'z'", "last_element([[0]]) == [0]"),
    _problem("def sum_list(numbers):", "Return the sum of the numbers in the list.", "return sum(numbers)",
             "sum_list([1, 2, 3]) == 6", "sum_list([]) == 0", "sum_list([-1, 1, 5]) == 5"),
    _problem("def join_words(words):", "Return the words joined into one string with single spaces.",
             "return ' '.join(words)",
             "join_words(['a', 'b', 'c']) == 'a b c'", "join_words(['one']) == 'one'", "join_words([]) == ''"),
    _problem("def count_char(text, char):", "Return how many times the character char occurs in text.",
             "return text.count(char)",
             "count_char('banana', 'a') == 3", "count_char('banana', 'z') == 0", "count_char('', 'a') == 0"),
    _problem("def celsius_to_fahrenheit(celsius):", "Convert a temperature from degrees Celsius to Fahrenheit.",
             "return celsius * 9 / 5 + 32",
             "celsius_to_fahrenheit(0) == 32", "celsius_to_fahrenheit(100) == 212",
             "celsius_to_fahrenheit(-40) == -40"),
    _problem("def sign(x):", "Return -1, 0 or 1 according to the sign of the number x.",
             "if x > 0:\n    return 1\nif x < 0:\n    return -1\nreturn 0",
             "sign(12) == 1", "sign(-0.5) == -1", "sign(0) == 0"),
    _problem("def clamp(value, low, high):", "Return value limited to the closed range from low to high.",
             "return max(low, min(value, high))",
             "clamp(5, 0, 10) == 5", "clamp(-3, 0, 10) == 0", "clamp(42, 0, 10) == 10"),
    _problem("def average(numbers):", "Return the arithmetic mean of the non-empty list numbers.",
             "return sum(numbers) / len(numbers)",
             "average([1, 2, 3, 4]) == 2.5", "average([7]) == 7", "average([-2, 2]) == 0"),
    _problem("def power(base, exponent):", "Return base raised to the non-negative integer exponent.",
             "return base ** exponent",
             "power(2, 10) == 1024", "power(5, 0) == 1", "power(-3, 3) == -27"),
    _problem("def get_extension(filename):",
             "Return the extension of filename without the dot, or an empty string if it has none.",
             "head, dot, tail = filename.rpartition('.')\nreturn tail if dot else ''",
             "get_extension('notes.txt') == 'txt'", "get_extension('archive.tar.gz') == 'gz'",
             "get_extension('README') == ''"),
    _problem("def count_vowels(text):", "Return the number of vowels (a, e, i, o, u) in text, ignoring case.",
             "return sum(1 for c in text.lower() if c in 'aeiou')",
             "count_vowels('Hello World') == 3", "count_vowels('rhythm') == 0", "count_vowels('AEIOUaeiou') == 10"),
    _problem("def count_words(text):", "Return the number of whitespace-separated words in text.",
             "return len(text.split())",
             "count_words('the quick brown fox') == 4", "count_words('  spaced   out  ') == 2",
             "count_words('') == 0"),
    _problem("def is_palindrome(s):", "Return True if the string s reads the same forwards and backwards.",
             "return s == s[::-1]",
             "is_palindrome('level') is True", "is_palindrome('python') is False", "is_palindrome('') is True"),
    _problem("def even_numbers(numbers):", "Return a list of the even numbers in numbers, in their original order.",
             "return [n for n in numbers if n % 2 == 0]",
             "even_numbers([1, 2, 3, 4, 6]) == [2, 4, 6]", "even_numbers([1, 3]) == []",
             "even_numbers([0, -2, 5]) == [0, -2]"),
    _problem("def count_positive(numbers):", "Return how many numbers in the list are greater than zero.",
             "return sum(1 for n in numbers if n > 0)",
             "count_positive([1, -2, 3, 0]) == 2", "count_positive([]) == 0", "count_positive([-1, -5]) == 0"),
    _problem("def word_lengths(words):", "Return a list with the length of each string in words.",
             "return [len(w) for w in words]",
             "word_lengths(['a', 'abc', '']) == [1, 3, 0]", "word_lengths([]) == []"),
    _problem("def factorial(n):", "Return the factorial of the non-negative integer n.",
             "result = 1\nfor i in range(2, n + 1):\n    result *= i\nreturn result",
             "factorial(0) == 1", "factorial(1) == 1", "factorial(5) == 120", "factorial(10) == 3628800"),
    _problem("def fibonacci(n):", "Return the n-th Fibonacci number, where fibonacci(0) is 0 and fibonacci(1) is 1.",
             "a, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nreturn a",
             "fibonacci(0) == 0", "fibonacci(1) == 1", "fibonacci(2) == 1", "fibonacci(10) == 55"),
    _problem("def list_product(numbers):", "Return the product of the numbers in the list, or 1 if it is empty.",
             "result = 1\nfor n in numbers:\n    result *= n\nreturn result",
             "list_product([2, 3, 4]) == 24", "list_product([]) == 1", "list_product([5, 0]) == 0"),
    _problem("def digit_sum(n):", "Return the sum of the decimal digits of the non-negative integer n.",
             "return sum(int(d) for d in str(n))",
             "digit_sum(0) == 0", "digit_sum(1234) == 10", "digit_sum(999) == 27"),
    _problem("def gcd(a, b):", "Return the greatest common divisor of the positive integers a and b.",
             "while b:\n    a, b = b, a % b\nreturn a",
             "gcd(12, 18) == 6", "gcd(7, 5) == 1", "gcd(9, 3) == 3"),
    _problem("def is_prime(n):", "Return True if the integer n is a prime number, else False.",
             "if n < 2:\n    return False\nfor d in range(2, int(n ** 0.5) + 1):\n    if n % d == 0:\n"
             "        return False\nreturn True",
             "is_prime(2) is True", "is_prime(17) is True", "is_prime(1) is False", "is_prime(21) is False"),
    _problem("def safe_divide(a, b):", "Return a divided by b, or None when b is zero.",
             "if b == 0:\n    return None\nreturn a / b",
             "safe_divide(6, 3) == 2", "safe_divide(1, 4) == 0.25", "safe_divide(1, 0) is None"),
    _problem("def parse_int(text, default):", "Return text converted to an int, or default if it is not an integer.",
             "try:\n    return int(text)\nexcept ValueError:\n    return default",
             "parse_int('42', 0) == 42", "parse_int(' -7 ', 0) == -7", "parse_int('abc', -1) == -1"),
    _problem("def is_sorted(items):", "Return True if the list items is in non-decreasing order.",
             "return all(a <= b for a, b in zip(items, items[1:]))",
             "is_sorted([1, 2, 2, 5]) is True", "is_sorted([3, 1]) is False", "is_sorted([]) is True"),
    _problem("def capitalize_words(text):",
             "Return text with the first letter of every space-separated word upper-cased.",
             "return ' '.join(w[:1].upper() + w[1:] for w in text.split(' '))",
             "capitalize_words('hello world') == 'Hello World'", "capitalize_words('a') == 'A'",
             "capitalize_words('') == ''"),
    _problem("def flatten(lists):", "Return one list with the elements of the given lists, in order.",
             "return [x for inner in lists for x in inner]",
             "flatten([[1, 2], [3], []]) == [1, 2, 3]", "flatten([]) == []",
             "flatten([['a'], ['b', 'c']]) == ['a', 'b', 'c']"),
    _problem("def remove_duplicates(items):", "Return the elements of items without repeats, in first-seen order.",
             "seen = []\nfor x in items:\n    if x not in seen:\n        seen.append(x)\nreturn seen",
             "remove_duplicates([3, 1, 3, 2, 1]) == [3, 1, 2]", "remove_duplicates([]) == []",
             "remove_duplicates(['a', 'a']) == ['a']"),
    _problem("def running_total(numbers):", "Return the list of cumulative sums of numbers.",
             "total, out = 0, []\nfor n in numbers:\n    total += n\n    out.append(total)\nreturn out",
             "running_total([1, 2, 3]) == [1, 3, 6]", "running_total([]) == []", "running_total([5, -5]) == [5, 0]"),
    _problem("def char_frequency(text):", "Return a dict mapping each character of text to how often it occurs.",
             "counts = {}\nfor c in text:\n    counts[c] = counts.get(c, 0) + 1\nreturn counts",
             "char_frequency('abca') == {'a': 2, 'b': 1, 'c': 1}", "char_frequency('') == {}"),
    _problem("def invert_dict(mapping):", "Return a new dict that maps each value of mapping to its key.",
             "return {v: k for k, v in mapping.items()}",
             "invert_dict({'a': 1, 'b': 2}) == {1: 'a', 2: 'b'}", "invert_dict({}) == {}"),
    _problem("def chunk(items, size):",
             "Return items split into consecutive lists of length size; the last may be shorter.",
             "return [items[i:i + size] for i in range(0, len(items), size)]",
             "chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]", "chunk([], 3) == []",
             "chunk([1, 2], 5) == [[1, 2]]"),
    _problem("def to_binary(n):",
             "Return the binary digits of the non-negative integer n as a string, without a prefix.",
             "return bin(n)[2:]",
             "to_binary(0) == '0'", "to_binary(5) == '101'", "to_binary(255) == '11111111'"),
)


def _limit(timeout: float):
    """Resource limits for the child, set between fork and exec; nothing where `resource` is missing."""
    try:
        import resource
    except ImportError:
        return None

    def apply():
        cpu = math.ceil(timeout) + 1
        for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, MEMORY_LIMIT),
                             (resource.RLIMIT_FSIZE, FILE_LIMIT), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))

    return apply


def run_problem(source: str, tests: str, timeout: float = 5.0) -> bool:
    """True iff `source` followed by the assert lines `tests` runs to exit status 0 within `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="exec_eval_") as tmp:
        program = Path(tmp) / "candidate.py"
        program.write_text(NO_NETWORK + source + "\n" + tests, encoding="utf-8")
        proc = subprocess.Popen([sys.executable, "-I", str(program)], cwd=tmp, env={}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_limit(timeout))
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and anything it started (its own session), then reap it."""
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def completed_functions(model, tokenizer, problems=PROBLEMS, max_new_tokens=128, batch_size=40,
                        repetition_penalty=None) -> list[str]:
    """The function each problem's greedy completion defines (`cut_completion`); plain greedy unless the caller
    gives a repetition penalty (the model's generation_config is not consulted for one)."""
    kwargs = {} if repetition_penalty is None else {"repetition_penalty": repetition_penalty}
    texts = complete(model, tokenizer, [p.prompt for p in problems], max_new_tokens, batch_size, **kwargs)
    return [cut_completion(p.prompt, text, ended) for p, (text, ended) in zip(problems, texts)]


def pass_at_1(model, tokenizer, problems=PROBLEMS, max_new_tokens=128, batch_size=40, repetition_penalty=None,
              timeout=5.0) -> list[bool]:
    """Per problem: does its greedy completion pass its tests."""
    functions = completed_functions(model, tokenizer, problems, max_new_tokens, batch_size, repetition_penalty)
    return [run_problem(f, p.tests, timeout) for p, f in zip(problems, functions)]


def wilson_interval(k: int | float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n (the whole [0, 1] when n is 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def sign_test(differences) -> float:
    """Two-sided exact sign-test p-value of paired differences (zeros dropped); on two models' pass/fail outcomes
    it is McNemar's exact test."""
    above = sum(d > 0 for d in differences)
    below = sum(d < 0 for d in differences)
    n = above + below
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(above, below) + 1)) / 2 ** n)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "demo" / "parent"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=40)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--json", default=None, help="also write the completions and results here")
    args = parser.parse_args(argv)
    model, tokenizer = load(args.model)
    t0 = time.time()
    functions = completed_functions(model, tokenizer, PROBLEMS, args.max_new_tokens, args.batch_size,
                                    args.repetition_penalty)
    t1 = time.time()
    passed = [run_problem(f, p.tests) for p, f in zip(PROBLEMS, functions)]
    t2 = time.time()
    for p, f, ok in zip(PROBLEMS, functions, passed):
        print(f"--- {'PASS' if ok else 'fail'}: {p.name}\n{f}")
    k, n = sum(passed), len(passed)
    lo, hi = wilson_interval(k, n)
    print(f"=> pass@1 {k}/{n} = {k / n:.1%} (95 % Wilson {lo:.1%}-{hi:.1%}); generation {t1 - t0:.1f} s, "
          f"execution {t2 - t1:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "settings": vars(args), "passed": k, "problems": n,
                                               "generation_s": t1 - t0, "execution_s": t2 - t1,
                                               "results": [dict(name=p.name, function=f, passed=ok) for p, f, ok
                                                           in zip(PROBLEMS, functions, passed)]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

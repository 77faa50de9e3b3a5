"""Bounds on a chat template's work. A template is the model's code, shipped in its tokenizer
config, and a server renders it for every chat request: jinja's sandbox keeps it from Python's
internals but not from spinning or allocating. Two nested `range(100000)` loops held the threads
that render and encode prompts until no request of any kind was answered, and `'x' * 2**33` took
8 GB (hostile-artifact probe, session 48).

Owns `BoundedSandbox` (jinja's immutable sandbox that refuses huge repetitions and powers, also when
jinja folds constants at compile time) and `render_bounded` (a render stopped at a deadline by a
trace function on the template's own frames only, so the rest of the process runs untraced).
"""

import sys
import time

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Far past what a chat template does (Llama 3's renders a conversation in well under a millisecond)
RENDER_SECONDS = 5.0
MAX_REPEAT_ITEMS = 1 << 20  # characters or items a `*` may make
MAX_EXPONENT = 1024


class RenderTimeout(Exception):
    pass


class BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})  # also stops jinja folding them at compile time

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"a power of {right!r} is past the {MAX_EXPONENT} a chat template may raise to")
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                        len(seq) * times > MAX_REPEAT_ITEMS:
                    raise SecurityError(f"repeating {len(seq)} items {times} times is past the {MAX_REPEAT_ITEMS} "
                                        "a chat template may make")
        return super().call_binop(context, operator, left, right)


def render_bounded(template, variables: dict, seconds: float | None = None) -> str:
    """template.render(**variables), raising RenderTimeout once it has run `seconds` (default
    RENDER_SECONDS). The check runs on each line of the template's compiled code (its frames' file
    is "<template>")."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    deadline = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderTimeout(f"the chat template ran past {seconds:g} s; it loops too long for these messages")
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return template.render(**variables)
    finally:
        sys.settrace(previous)

"""The lab model's chain of thought: a search in which every decision is local, with free wording and rare slips.

A K&K puzzle is solved by trying whole assignments in a fixed order (all knights first, then counting in binary with
knave = 1, the last person flipping fastest) and checking each person's statement under the assignment until one
fails. Every token the model must get right depends only on a few tokens just before it:

    Suppose Logan knight , Sebastian knight , Daniel knave .              # the next assignment: +1 on the last line
    Daniel says Sebastian knave false and Logan knave false so false ,    # the statement, restated from the quiz,
        Daniel knave ok .                                                 # each leaf's truth read off the line above
    Logan claims Sebastian knave false and Daniel knight false hence false , Logan knight no .
    Try Logan knight , Sebastian knave , Daniel knight .                  # a failed check ends the line
    ...
    </think><answer>(1) Logan is a knave ...</answer>                    # all checks passed: copy the line

Two kinds of variety make the model's own rollouts look like an LLM's (docs/paper.md §5: a fifth of the tokens of a
GRPO rollout below p = 0.25), without deciding correctness:

- **wording**: the opening verb of a line, the verb after the speaker and the connective before the verdict are drawn
  from small synonym sets (one token each);
- **search order**: the statements of a line are checked in a random order (a failing line stops at its first
  failed check, so the order also changes how long the line is).

And one kind of error makes room for RL: with probability ``slip`` a truth value (a leaf's, or a statement's) is
written wrong, and the search goes on from the wrong belief, exactly as a solver that misread would: it may accept
a wrong assignment (a wrong answer) or reject the right one. The supervised model learns to slip at about that rate
when it samples, and almost never when it decodes greedily: sampled accuracy sits below greedy accuracy, and GRPO
can close the gap by removing the slips.

Two options move a lookup into the trace itself, after measuring where a trained model errs
(benchmarks/README.md): ``leaf_roles`` writes the line's role of each leaf's person before its value ('Sebastian
knave is knight false': a copy, then a comparison of two adjacent words, instead of a lookup and a comparison in one
token), and ``restate_line`` repeats the line's roles before each check but a line's first. ``coded`` numbers the
people and writes each line as one word ('Try KNK .', restated after every check's speaker), so that a role is read
by a fixed number off a word in the same sentence instead of by a name off the latest of many lines. With
``numbered_quiz`` the prompt numbers the people too, and with ``numbers_only`` a person after the roster is their
number alone ('1 KNK says 2 knave ...'), so no name is ever matched to its number; ``answer_roster`` writes the
roster as the answer numbers the people ('(1) Logan (2) Sebastian .'); ``bare_quiz`` drops the quiz's shared
sentences from the prompt.

``lab_trace(puzzle, rng)`` returns the response that follows the prompt's ``<think>``; ``TraceStyle`` holds the
knobs. Worked example: ``lab_trace(p, random.Random(0), TraceStyle(slip=0.0))`` for a 2-person puzzle whose
solution is (knave, knight) writes a failing line for (knight, knight), then for (knight, knave), then the line
(knave, knight) with both checks ok, then the answer.

The package: ``style`` (the knobs, the search order, the words), ``write`` (writing traces), ``audit`` (reading
them back).
"""

from lopti_lab.lab.trace.audit import TraceAudit, add_at, audit_trace
from lopti_lab.lab.trace.style import (
    AS_AND,
    HARD_TRACE,
    RL_PROMPT_STYLE,
    RL_TRACE,
    TraceStyle,
    assignments,
    line_code,
    person,
    prompt_style,
    render_claim,
    trace_vocabulary,
)
from lopti_lab.lab.trace.write import TraceStats, ideal_profile, lab_trace, lab_trace_with_stats

__all__ = [
    "AS_AND",
    "HARD_TRACE",
    "RL_PROMPT_STYLE",
    "RL_TRACE",
    "TraceAudit",
    "TraceStats",
    "TraceStyle",
    "add_at",
    "assignments",
    "audit_trace",
    "ideal_profile",
    "lab_trace",
    "lab_trace_with_stats",
    "line_code",
    "person",
    "prompt_style",
    "render_claim",
    "trace_vocabulary",
]

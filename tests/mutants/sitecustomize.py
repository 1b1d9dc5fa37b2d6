"""Breaks one feature on purpose in every Python process that starts with this folder on PYTHONPATH (pytest and
the servers it launches), chosen by LLAMA_MUTANT; tests/mutants/run.py shows that each tightened test fails then.
Never on the path in a normal run."""

import os

MUTANT = os.environ.get("LLAMA_MUTANT", "")


def _no_drafts():
    """Speculation never drafts: outputs stay right, so only the acceptance checks can notice."""
    from llama.core.speculation import speculative

    speculative.Speculator.plan = lambda self, plan, budget=speculative.MAX_ROWS: None


def _no_prefix_hits():
    """The prefix cache never finds a block: outputs stay right, so only the hit checks can notice."""
    from llama.core.scheduling import block_pool

    block_pool.BlockPool.lookup = lambda self, tokens, salt=b"", limit=None: []


def _wrong_block():
    """A cache hit's last block is swapped for another cached block: the hit is counted, the keys and values are
    another prompt's."""
    from llama.core.scheduling import block_pool

    lookup = block_pool.BlockPool.lookup

    def wrong(self, tokens, salt=b"", limit=None):
        blocks = lookup(self, tokens, salt, limit)
        others = [b for b in self.key_of if b not in blocks]
        return blocks[:-1] + [others[0]] if blocks and others else blocks

    block_pool.BlockPool.lookup = wrong


def _publish_rejected():
    """When a draft is rejected, its blocks are keyed with the whole draft as fed to the verify pass, as if it had
    been accepted (the keys and values under the key are the draft's: only the tokens keyed are wrong)."""
    from llama.core.scheduling import paging
    from llama.core.speculation import speculative

    pagings, init, accepted = [], paging.Paging.__init__, speculative.Speculator.accepted

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pagings.append(self)

    def publish_draft(self, r, draft, n):
        if n < len(draft) and pagings and not r.finished:
            before = r.generated[: len(r.generated) - (n + 1)]  # the tokens before this step's n + 1
            pg = pagings[-1]
            salt = pg._salt(r)
            if salt is not None:
                pg.pool.publish(r.prompt + before + list(draft), r.blocks, salt)
        return accepted(self, r, draft, n)

    paging.Paging.__init__ = remember
    speculative.Speculator.accepted = publish_draft


def _resume_without_output():
    """A preempted request resumes from its prompt alone, forgetting the tokens it had generated."""
    from llama.core.frontend import request

    request.Request.context = property(lambda self: self.prompt)


def _named_choice_parallel():
    """A named tool_choice allows several calls unless parallel_tool_calls is false (the old behaviour)."""
    from llama.serve import tools

    parse_request = tools.parse_request

    def parse(body):
        t = parse_request(body)
        if t is not None and t.choice not in ("auto", "none", "required"):
            t.parallel = body.get("parallel_tool_calls") is not False
        return t

    tools.parse_request = parse


MUTANTS = {"no_drafts": _no_drafts, "no_prefix_hits": _no_prefix_hits, "publish_rejected": _publish_rejected,
           "resume_without_output": _resume_without_output, "named_choice_parallel": _named_choice_parallel,
           "wrong_block": _wrong_block}

if MUTANT:
    MUTANTS[MUTANT]()

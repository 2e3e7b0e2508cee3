"""What the chain-drafter specs (Eagle3, MTP) share: batcher and proposers (one batch-1 proposer per request
in the batched loop)."""

from __future__ import annotations

from deepspec.decoding.proposers import PerRequestBatchProposer
from deepspec.drafters.chain.batching import ChainBatcher
from deepspec.drafters.chain.proposer import ChainDrafterProposer, RowInputs


def make_chain_batcher(config, settings) -> ChainBatcher:
    return ChainBatcher(config, settings)


def chain_proposers(row_inputs: RowInputs, default_num_draft):
    """(proposer, batch_proposer) factories for a chain kind; `default_num_draft(config)` = drafts per round."""

    def proposer(drafter, num_draft_tokens: int | None = None) -> ChainDrafterProposer:
        return ChainDrafterProposer(drafter, row_inputs, default_num_draft(drafter.config), num_draft_tokens)

    def batch_proposer(drafter, num_draft_tokens: int | None = None) -> PerRequestBatchProposer:
        return PerRequestBatchProposer(lambda: proposer(drafter, num_draft_tokens))

    return proposer, batch_proposer

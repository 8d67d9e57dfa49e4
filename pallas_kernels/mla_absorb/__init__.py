"""The absorbed MLA projections of a decode step (W_UK into the queries, W_UV out of the latents)
as few-row kernels reading the kv_b_proj kernel where it is stored, with their XLA twins."""

from pallas_kernels.mla_absorb.kernel import (ROWS, AbsorbBlocks, absorb_query_pallas, absorb_refusal,
                                              absorb_value_pallas, padded_tokens)
from pallas_kernels.mla_absorb.reference import absorb_query_reference, absorb_value_reference

__all__ = ["absorb_query_pallas", "absorb_value_pallas", "absorb_query_reference", "absorb_value_reference",
           "absorb_refusal", "padded_tokens", "AbsorbBlocks", "ROWS"]

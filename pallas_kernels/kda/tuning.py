"""Block sizes and launch settings of the KDA kernels (small frozen dataclasses, static args)."""

from __future__ import annotations

from dataclasses import dataclass, replace


VALUE_BLOCK_CHOICES = (1, 2, 4, 8)
MIN_BLOCK_COLUMNS = 16


def value_blocks_fit(value_dim: int, blocks: int) -> bool:
    """Whether `blocks` column blocks cut a head of value_dim columns into whole blocks of at least
    MIN_BLOCK_COLUMNS columns."""
    return value_dim % blocks == 0 and value_dim // blocks >= MIN_BLOCK_COLUMNS


@dataclass(frozen=True)
class DecodeBlocks:
    """num_warps: H200 sweep: 4 beat 8 and 16 at every batch (benchmarks/RESULTS.md).
    value_blocks: programs per (row, head) of the one-token kernel, each over V / value_blocks state
    columns; 0 (auto) splits heads in two from `split_from` rows x heads on, by default never (H200,
    48B shape, end to end: at B=1 four blocks made the kernel 6.6 -> 4.1 us but added the norm and a
    conv-state copy as two more launches, 2.564 ms per token against 2.509 unsplit; at B=64 two
    blocks, 134 -> 115 us per layer alone, gave 20.44 ms against 20.28)."""

    num_warps: int = 4
    value_blocks: int = 0
    split_from: int | None = None
    column_block: int = 0     # one-token kernel, one program per (row, head): 0 reads and writes the head's whole
                              # [K, V] state at once; n > 0 walks it in a loop of n-column blocks (the delta rule is
                              # independent per column), so a program holds n columns and more programs share an SM.
                              # H200, H = 32 (RESULTS.md, KDA decode runs 4 and 7): no faster than the whole-state
                              # kernel at any batch since its store moved ahead (run 7, B = 8: 37-45 us against 29-30),
                              # so 0 stays the default.
                              # One program per head only: not with value_blocks > 1. (Triton's num_stages does not
                              # pipeline the loop's loads: no matrix product consumes them; ptxas identical at 2)

    def __post_init__(self):
        if self.value_blocks not in (0,) + VALUE_BLOCK_CHOICES:
            raise ValueError(f"DecodeBlocks: value_blocks must be 0 (auto) or one of {VALUE_BLOCK_CHOICES}, "
                             f"got {self.value_blocks!r}")
        cb = self.column_block
        if isinstance(cb, bool) or not isinstance(cb, int) or cb < 0 or (cb and (cb < 16 or cb & (cb - 1))):
            raise ValueError(f"DecodeBlocks: column_block must be 0 (whole state) or a power of two >= 16, "
                             f"got {cb!r}")
        if cb and self.value_blocks not in (0, 1):
            raise ValueError(f"DecodeBlocks: column_block={cb} walks one program's whole head; it does not combine "
                             f"with value_blocks={self.value_blocks}")
        if self.value_blocks == 1 or (self.value_blocks == 0 and self.split_from is None):
            self._refuse_whole_state_warps()

    def _refuse_whole_state_warps(self) -> None:
        """More than 4 warps over one (row, head)'s whole state: on an H100 (B = 64, H = 32, K = V = 128; RESULTS.md,
        run 34) its state after two steps was 2.95% off the XLA reference, against 0.13% with 4 warps or with 8 warps
        and value_blocks=2 (run 32's 2.6% most likely the same launch). Triton 3.6 compiles it with its inputs
        loaded twice, in two layouts (335 global loads against 62 at 4 warps, `triton_resources.py`); why the result
        is off was not found. A column_block loop at 8 warps was not checked."""
        if self.num_warps > 4 and not self.column_block:
            raise ValueError(f"DecodeBlocks: num_warps={self.num_warps} with one program over a head's whole state "
                             f"measured wrong on the GPU (a state 3% off the reference); use num_warps=4 or "
                             f"value_blocks=2")

    def value_blocks_for(self, rows: int, heads: int, value_dim: int) -> int:
        """The column blocks per head for a [rows, heads, K, value_dim] state (blocks of >= 16
        columns)."""
        fits = [n for n in VALUE_BLOCK_CHOICES if value_blocks_fit(value_dim, n)]
        if self.value_blocks:
            if self.value_blocks not in fits:
                raise ValueError(f"kda_decode: value_blocks={self.value_blocks} does not split V={value_dim} into "
                                 f"blocks of >= 16 columns")
            return self.value_blocks
        blocks = 2 if self.split_from is not None and rows * heads >= self.split_from and 2 in fits else 1
        if blocks == 1:
            self._refuse_whole_state_warps()
        return blocks


ONE_WAVE_STAGES = 3      # pipeline stages of the sequential KDA pass when its grid is a single wave, at most
STAGE_SHARED_BYTES = 200 * 1024   # ... and their loads' shared memory (3 x 60 KB compiled to 188 KB; the H200 gives
                                  # a block 227 KB)
PARALLEL_MAX_CHUNK = 64   # the "parallel" form's doubling inverse of a 128-row chunk needs 384 KB of shared memory


@dataclass(frozen=True)
class ChunkBlocks:
    """Forms and launch settings of the chunked prefill. "auto" fields are settled per call by
    `resolve` (from the chunk and the inputs' dtype). B = 1, T = 8192, K = V = 128, bf16, q and k normalised inside
    (benchmarks/RESULTS.md): H100 (KDA run 29): these defaults with the W, U loop in 2 stages 1.482 / 3.585 ms at
    H = 32 / 96 against fla's 1.771 / 3.746 in the same runs (device time 1,127 / 3,328 us against 1,259 / 3,565;
    3 stages, the default since: 3,252 us at H = 96); run 27's defaults 1.693 / 4.205 ms. H200 (run 27): run 27's
    defaults 1.507 / 3.853 ms against fla's 1.381 / 3.118 (device time 1,168 / 3,478 us against 1,062 / 2,942); run
    24's defaults 1,217 / 3,662 us in that run; run 19's 1,366 / 4,148 us (run 21); the joint pairs launch with the
    one-launch solve 1.866 / 5.067 ms (run 19); the blocked form with fp32 factors 4.67 ms at H = 32 (run 5)."""

    chunk: int = 64          # tokens per chunk (WY form)
    intra: str = "auto"      # intra-chunk kernel: "parallel" (no row-serial loops: `intra_parallel.py`; chunks
                             # <= 64), "blocked" (sub-block matmuls, row-serial diagonal blocks), "column"
                             # (pairwise loop); auto: parallel up to PARALLEL_MAX_CHUNK, else blocked
    pairs: str = "diagonal"  # "parallel": the diagonal 16 x 16 blocks of A_kk and A_qk one program per token
                             # (`intra_diagonal.py`), then one launch adds the levels across sub-blocks ("diagonal");
                             # every level in one launch ("joint", the default before 2026-12-04 late: its four
                             # levels inside a sub-block were 425 of its 685 us at H = 32), one launch each
                             # ("separate"), or one launch by 16-row tiles ("tiles": `intra_tiles.py`, a quarter of
                             # the product work; slower on the H200: 2.00 against 1.93 ms at H = 32 at best, 1 warp)
    pairs_num_warps: int = 0  # warps of the pair launches (A_kk / A_qk, any `pairs` form; 0: 1 with across="tiles",
                              # else num_warps)
    across: str = "auto"     # pairs="diagonal" with solve="sliced": the launch after the per-token one forms the
                             # pairs across sub-blocks as bit levels of masked [C, C] products and the inverse by
                             # doubling over [C, C] ("levels", `joint_pairs_kernel`), or both by 16 x 16 tiles
                             # ("tiles": one product a tile pair, block forward substitution;
                             # `intra_solve_tiles.py`, about a tenth of the multiply-adds); auto: tiles where the
                             # pairs and solve forms allow it. H200, device time, H = 32 / 96 (KDA run 25): levels
                             # 352 / 1,028 us; tiles at 1 warp 352 / 1,053, at 4 warps 918 / 2,697 (a [16, 16]
                             # tile sits whole in every warp); (run 26) tiles at 1 warp, 16 key columns a step,
                             # 3 stages (the default `pairs_launch`) 344 / 966 against the levels' 352 / 1,036
    pairs_key_slice: int = 0  # key columns a loop step of the pairs launch (0: 16 with across="tiles", else
                              # key_slice)
    pairs_exp2: bool = True   # across="tiles" (ignored by the other launches): the pairs launch's decays as
                              # 2^(x log2 e) (a multiply and one ex2.approx) instead of e^x (a longer sequence), in
                              # its product loops, which take 672 exponentials a thread a chunk: sm_90a, about
                              # 17.5k instructions a program with e^x, 12.0k with 2^x (`triton_resources.py`)
    pairs_one_loop: bool = True   # across="tiles" (ignored by the other launches): the products across sub-blocks
                                  # in one loop over key slices for every block pair (each block's tiles loaded and
                                  # its factors taken once a step), instead of a loop per row block. Both on, H200
                                  # run 31 (B = 1, T = 8192): the pairs launch 271 -> 205 us at H = 32, the prefill
                                  # at H = 96 1.04x fla host-timed and pipelined (0.97x pipelined without)
    qg_in_pairs: bool = False    # across="tiles": q e^G written by the pairs launch (from its rows' factors, which
                                 # it forms anyway, times e^ of their block's start) instead of the W, U launch,
                                 # which then neither reads q nor writes q e^G: at H = 96, T = 8192 it moves 402 MB
                                 # less (the W, U launch is bound by memory) and the pairs launch 201 MB more;
                                 # with e^x and a loop per block (H200, run 31) 1% slower than without. Not with q
                                 # and k scaled in the later launches (qk_norm "scales*")
    solve: str = "auto"      # "parallel": T = (I + diag(beta) A_kk)^-1, then W, U, q e^G, k e^(G_C - G) in one launch
                             # per chunk ("whole"), or the inverse at the end of the pairs launch (stored in the
                             # factors' dtype) and the rest one program per chunk and key slice ("sliced";
                             # pairs "joint" or "diagonal"); auto: sliced where the pairs form allows it.
                             # H200, H = 32, device time (KDA run 18): pairs 260 -> 361 us, W, U, ... 500 -> 334
    diagonal_heads: int = 0  # pairs="diagonal": heads per program of the per-token launch (1, 2, 4 or 8) where the
                             # call takes the tokens layout, else 1; 0 (auto): 2 where H is even
                             # (H200, H = 32: 1 / 2 / 4 heads 310 / 288 / 285 us)
    diagonal_num_warps: int = 0  # ... and its warps (a program holds [heads, K] rows; 0 (auto): one for every two
                                 # heads, at least one; one a head before KDA run 28). H100, run 28, together with
                                 # 2^x and bf16 q, k: per-token launch 387 -> 321 us at H = 32, 1,129 -> 938 at
                                 # H = 96 against run 27's defaults (2 heads at 2 warps, e^x, fp32 q, k)
    qk_norm: str = "auto"        # `kda_chunk_pallas(normalize_qk=True)`: q and k L2-normalised inside the per-token
                                 # launch, which writes them in fp32 ("diagonal") or bf16 ("diagonal-bf16", as fla's
                                 # norm returns them; auto: with bf16 values, else "diagonal")
                                 # for the launches after it ("diagonal-after": the walk on raw
                                 # k rows, the band scaled by the sub-block's 1 / |k_j| at the end, one sum a row
                                 # instead of one a step), or writes only 1 / |q| and 1 / |k| (a
                                 # float a row) for the later launches to scale q and k by as they read them
                                 # ("scales", "scales-after": the walk as in "diagonal", "diagonal-after"; with
                                 # solve="sliced"; KDA run 24: per-token launch 384 -> 389 us, pairs 352 -> 409,
                                 # W, U 262 -> 244 at H = 32, so slower; "diagonal-after": per-token 384 -> 432),
                                 # or by XLA before the kernels ("xla",
                                 # also wherever the per-token launch does not run). H200, device time (KDA run 22):
                                 # per-token launch 299 -> 385 us against XLA's norm 97 at H = 32, 872 -> 1,125
                                 # against 292 at H = 96 (sums 1,232 -> 1,219 and 3,717 -> 3,679 us). Registers of
                                 # the tile pairs launch (sm_90a): 245 with "diagonal", 168 with "diagonal-bf16"
                                 # (8 -> 12 one-warp programs a multiprocessor); H100, KDA run 28, together with 2^x
                                 # and one warp, against run 27's defaults: pairs 405 -> 301 us, W, U 293 -> 263 at
                                 # H = 32 (1,125 -> 853 and 841 -> 734 at H = 96); o within 4e-3 of the fp32
                                 # reference, as with fp32 q, k (fla: 4.5e-3)
    diagonal_exp2: bool = True   # ... carries its decay in base-2 units and takes 2^x (one ex2.approx) instead of
                                 # e^x (a longer sequence): its loop 133 -> 91 PTX instructions a step (sm_90a,
                                 # 2 heads at 2 warps); H100, KDA run 28, with one warp for the two heads:
                                 # per-token launch 387 -> 340 us at H = 32 (2^x alone untimed)
    diagonal_band: bool = True   # ... writes only the diagonal blocks, [C, 16] a chunk, for the pairs launch to
                                 # expand (else whole [C, C] rows, three quarters zeros)
    inverse: str = "auto"    # "parallel": products of the (I + L)^-1 doubling on the GPU, "tf32x3" (about fp32)
                             # or "tf32" (as fla); auto: tf32 with bf16 factors, else tf32x3
    cumsum: str = "auto"     # "parallel": the decay summed per 16-row sub-block in a Pallas launch ("pallas"), by
                             # XLA ("xla", a windowed reduction), or written by pairs="diagonal"'s per-token launch
                             # as its running sum's last value ("diagonal": no launch of its own); auto: "diagonal"
                             # with pairs="diagonal", else "pallas". H200, device time (KDA run 20): the per-token
                             # launch 289 -> 315 us against the cumsum launch's 69 at H = 32, 842 -> 878 against 208
                             # at H = 96; Pallas 2.94 -> 2.81 ms at H = 32 against XLA (host-timed, run 5)
    factors: str = "auto"    # dtype of W, U, A_qk, q e^G and k e^(G_C - G) between the two passes: "float32" or
                             # "bfloat16" (half the bytes; the sequential pass's products then run on bf16
                             # operands, the state kept fp32); auto: bf16 for bf16 values, else fp32
    sub_chunk: int = 16      # rows per sub-block of the blocked intra kernel ("parallel": always 16)
    key_slice: int = 32      # key (and value) columns per pass of the "parallel" kernels (bounds their registers)
    factors_slice: int = 64   # solve="sliced": key (and value) columns per program of the W, U, ... launch, or per
                              # step of its loop with factors_loop (0: key_slice). A program a slice, H200, device
                              # time (KDA run 20), H = 32 / 96: 32 columns at 4 warps 336 / 1,048 us, 64 at 4 warps
                              # 275 / 863, 64 at 8 288 / 866, 128 at 8 264 / 805 (128 at 4 warps spills: 255
                              # registers; `triton_resources.py --cases kda-chunk-fs128-w4`)
    factors_num_warps: int = 8   # ... and its warps (0: num_warps; 2 warps at 32 columns: 354 / 1,102 us)
    factors_loop: bool = True    # ... or one program a chunk walking the slices of factors_slice columns in a loop,
                                 # whose loads the compiler pipelines (factors_num_stages). H200, device time (KDA
                                 # run 26), H = 32 / 96: a program a slice at 128 columns, 8 warps 261 / 792 us; in a
                                 # loop 32 columns, 4 warps, 2 stages 237 / 702, 3 stages 226 / 678; 64 columns,
                                 # 8 warps, 2 stages (the default until run 29) 224 / 671. Registers with q, k
                                 # normalised inside (sm_90a): 139 at 64 columns, 8 warps, 2 stages (one program a
                                 # multiprocessor), 87 at 32 columns, 8 warps (two; untimed); since run 29 (bf16 q,
                                 # k handed on, 3 stages) 128 (two)
    factors_num_stages: int = 0  # ... the W, U launch's num_stages (0: with factors_loop 3 for bf16 factors, else
                                 # 2; without it num_stages). H100, device time at H = 96, bf16 values (KDA run 29,
                                 # two runs): 2 stages 779 / 782 us, 3 stages 721 / 714: 137 -> 128 registers
                                 # (sm_90a) at 8 warps lets two programs share a multiprocessor. With fp32 values 3
                                 # stages take 184 registers (175 at 2) and 133 KB of shared memory: still one
                                 # program a multiprocessor, untimed, so they keep 2
    pairs_num_stages: int = 0    # the pairs launch's num_stages (0: 3 with across="tiles", whose key-slice loops'
                                 # loads are pipelined, else num_stages: the levels' nested loops are not)
    value_block: int = 32    # state columns per program of the sequential kernel
    inter: str = "fused"     # sequential pass: "fused" (outputs inside the chunk loop) or "split" (a state-only
                             # pass, then every chunk's outputs in parallel: `inter_split.py`; fp32 factors)
    layout: str = "tokens"   # "parallel" with any cumsum but XLA's and the fused pass: the kernels read q, k, v, g,
                             # beta and write o in the caller's [B, T, H, ...] layout ("tokens"), or XLA moves
                             # them to [B, H, N, C, ...] and back ("chunked", the reference; the other forms)
    num_warps: int = 4       # intra-chunk kernel (H200: 4 beat 8)
    inter_num_warps: int = 4
    num_stages: int = 1
    inter_num_stages: int = 0   # the fused sequential kernel's; 0 (auto): up to ONE_WAVE_STAGES where its programs
                                # fit in one wave (at most one per multiprocessor) and the stages' loads fit
                                # STAGE_SHARED_BYTES, else num_stages. H200, T = 8192, bf16 (RESULTS.md, KDA runs
                                # 10-11): H = 32 (128 programs) 3 stages 0.678 -> 0.395 ms; at H = 96 (384 programs)
                                # 3 stages took 0.988 -> 1.09 ms (188 KB of shared memory: one program per SM)

    def sequential_stages(self, programs: int, multiprocessors: int, stage_bytes: int) -> int:
        """num_stages of the fused sequential pass's launch of `programs` programs on `multiprocessors` SMs,
        each stage holding `stage_bytes` of one chunk's loads: with one program per SM nothing else hides a
        program's load latency, so the loop's loads are pipelined as deep as shared memory allows (bf16
        factors at 64-token chunks: 60 KB a stage, 3 stages; fp32 factors: 120 KB, none)."""
        if self.inter_num_stages:
            return self.inter_num_stages
        if programs <= multiprocessors:
            for stages in range(ONE_WAVE_STAGES, 1, -1):
                if stages * stage_bytes <= STAGE_SHARED_BYTES:
                    return stages
        return self.num_stages

    def resolve(self, value_dtype: str) -> "ChunkBlocks":
        """These settings with every "auto" settled for values of `value_dtype` (a dtype name)."""
        intra = self.intra
        if intra == "auto":
            intra = "parallel" if self.chunk <= PARALLEL_MAX_CHUNK else "blocked"
        factors = self.factors
        if factors == "auto":
            factors = "bfloat16" if value_dtype == "bfloat16" and self.inter == "fused" else "float32"
        inverse = self.inverse
        if inverse == "auto":
            inverse = "tf32" if factors == "bfloat16" else "tf32x3"
        solve = self.solve
        if solve == "auto":
            solve = "sliced" if intra == "parallel" and self.pairs in ("joint", "diagonal") else "whole"
        cumsum = self.cumsum
        if cumsum == "auto":
            cumsum = "diagonal" if intra == "parallel" and self.pairs == "diagonal" else "pallas"
        across = self.across
        if across == "auto":
            across = "tiles" if intra == "parallel" and self.pairs == "diagonal" and solve == "sliced" else "levels"
        qk_norm = self.qk_norm
        if qk_norm == "auto":
            qk_norm = "diagonal-bf16" if value_dtype == "bfloat16" else "diagonal"
        return replace(self, intra=intra, factors=factors, inverse=inverse, solve=solve, cumsum=cumsum, across=across,
                       qk_norm=qk_norm)

    def pairs_launch(self) -> tuple[int, int, int]:
        """(warps, stages, key columns a loop step) of the pairs launch of these settled settings: the fields
        where set, else 1 warp, 3 stages and 16 columns for across="tiles" (H200, KDA run 26), num_warps,
        num_stages and key_slice otherwise."""
        if self.across == "auto":
            raise ValueError("ChunkBlocks.pairs_launch: across is 'auto'; call it on blocks.resolve(value dtype)")
        tiles = self.across == "tiles"
        return (self.pairs_num_warps or (1 if tiles else self.num_warps),
                self.pairs_num_stages or (3 if tiles else self.num_stages),
                self.pairs_key_slice or (16 if tiles else self.key_slice))

    def factors_launch(self) -> tuple[int, int]:
        """(warps, stages) of the solve="sliced" W, U, ... launch: the fields where set, else num_warps, and for
        its loop (factors_loop) 3 stages with bf16 factors (H100, KDA run 29), else 2 (H200, KDA run 26), or
        without the loop num_stages."""
        if self.factors_loop and not self.factors_num_stages and self.factors == "auto":
            raise ValueError("ChunkBlocks.factors_launch: factors is 'auto'; call it on blocks.resolve(value dtype)")
        loop_stages = 3 if self.factors == "bfloat16" else 2
        return (self.factors_num_warps or self.num_warps,
                self.factors_num_stages or (loop_stages if self.factors_loop else self.num_stages))

    def diagonal_launch(self, heads: int, tokens: bool) -> tuple[int, int]:
        """(heads per program, warps) of pairs="diagonal"'s per-token launch over `heads` heads; one head a
        program where the call does not take the tokens layout (the chunked layout, XLA's cumsum, the split
        pass, packed sequences), whatever diagonal_heads asks."""
        per = (self.diagonal_heads or (2 if heads % 2 == 0 else 1)) if tokens else 1
        return per, self.diagonal_num_warps or max(1, per // 2)

    @property
    def normalizes_qk(self) -> bool:
        """Whether a settled chunked prefill can L2-normalise q and k inside its per-token launch
        (`kda_chunk_pallas(normalize_qk=True)`)."""
        return (self.qk_norm != "xla" and self.intra == "parallel" and self.pairs == "diagonal"
                and (self.solve == "sliced" or not self.hands_on_norms))

    @property
    def hands_on_norms(self) -> bool:
        """Whether q and k normalised inside the per-token launch go on as they came, with their rows' inverse
        norms (qk_norm "scales" forms), rather than normalised."""
        return self.qk_norm.startswith("scales")

    @property
    def reads_tokens(self) -> bool:
        """Whether a settled chunked prefill reads its inputs and writes its outputs in the [B, T, H, ...]
        layout (see `layout`)."""
        return (self.layout == "tokens" and self.intra == "parallel" and self.cumsum in ("pallas", "diagonal")
                and self.inter == "fused")

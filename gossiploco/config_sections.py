"""The sections of a run configuration: one typed dataclass per component (``[model]``, ``[compute]``,
``[data]``, ``[inner]``, ``[outer]``, ``[mix1]``/``[mix2]``, ``[adaptive]``, ``[monitor]``, ``[timeouts]``,
``[transport]``, ``[checkpoint]``, ``[round]``), each with its own ``check``. ``gossiploco.config`` combines them
into ``RunConfig``, checks what spans sections and loads presets; import them from there."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gossiploco.blocks import FRAGMENT_ORDERS
from gossiploco.errors import ConfigError
from gossiploco.mixing.compression import COMPRESSIONS, TOPK_BITS, Codec, build_codec
from gossiploco.tokenizer import BYTE_SPECS

MIX_KINDS = ("identity", "global", "gossip")


@dataclass
class ModelConfig:
    size: str = "tiny"
    """Named model size: tiny, small, 125m or 1.5b (see gossiploco.model.MODEL_SIZES)."""
    precision: str = "fp32"
    """Inner-step compute precision: fp32, or bf16 (autocast; CUDA only, ignored on CPU)."""
    init: str = ""
    """A Hugging Face Llama-family checkpoint folder (config.json + safetensors) to start from; "": random weights
    of ``size``. Its config.json gives the model's shape (``size`` is then unused), its tokenizer.json the text
    tokenizer; its digest, not its path, is part of the run id (gossiploco.hf_checkpoint)."""

    def check(self, p: str) -> None:
        from gossiploco.model import MODEL_SIZES

        if self.size not in MODEL_SIZES:
            raise ConfigError(f"{p}.size", f"unknown size {self.size!r}; choose one of {sorted(MODEL_SIZES)}")
        _choice(f"{p}.precision", self.precision, ("fp32", "bf16"))

    def describe(self) -> str:
        """How messages name the model: its size, or the checkpoint it starts from."""
        return f"from {self.init}" if self.init else self.size

    def architecture(self, seq_len: int, vocab_size: int = 256):
        """The model's ``ModelArgs`` for a context of ``seq_len``: the checkpoint's with ``init`` (its own
        vocabulary; ``ConfigError`` on ``model.init`` for a folder it cannot use), else ``MODEL_SIZES[size]``
        with ``vocab_size`` ids."""
        from gossiploco.model import MODEL_SIZES, ModelArgs

        if self.init:
            from gossiploco.hf_checkpoint import folder_args

            return folder_args(self.init, seq_len)
        return ModelArgs(**{**MODEL_SIZES[self.size].__dict__, "vocab_size": vocab_size, "max_seq_len": max(seq_len, 1)})


@dataclass
class ComputeConfig:
    """How this peer computes (its own choice: peers with different values train together, so these
    fields are not part of the run id). None of them changes the math: the same batch gives the same
    update up to floating-point rounding."""

    compile: str = "auto"
    """torch.compile the model: on, off, or auto (on for CUDA, off on a CPU, where compiling costs more than it saves)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward pass; the gradients of data.batch_size / micro_batch_size passes are
    accumulated before each inner step, so the token batch does not depend on GPU memory. 0: the whole batch at once."""
    checkpoint_activations: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (about a third more
    compute, a fraction of the activation memory): for large models or long sequences."""
    outer_state: str = "auto"
    """Where the outer parameters z and momentum live: device (the outer step runs there; fastest), host
    (CPU memory; the outer step runs on the CPU), or auto (device when it has memory for them, see
    gossiploco.outer_state)."""
    companion: str = "auto"
    """Where a network peer's exchange runs (sockets, encryption, the protocol and the collectives' reductions): on,
    in a companion process beside the trainer (``gossiploco.companion``: the training thread shares its interpreter
    with no communication thread, tensors cross in shared memory; a second interpreter: about 150 MiB and 2 s to
    start); off, on threads of the training process; auto, off: on an H200 it kept the inner step as it was and
    made Mix2 about 35% slower (bench/results/gpu.md; on CPUs: README, "Mix1 beside training")."""
    companion_niceness: int = 0
    """With the companion on: its scheduling niceness above the trainer's (0-19). Where training and communication
    share the cores (a CPU peer, or a GPU peer whose cores are busy feeding it), a higher value gives a core to
    training first and communication the rest: Mix1 overlapped with the inner steps takes longer and slows them less
    (README, "Mix1 beside training"). A blocking exchange (Mix2) is unaffected while the trainer waits for it."""
    slowdown: float = 1.0
    """A stand-in for a slower machine (network peers, benchmarks and tests of unequal peers): after each inner
    step the peer sleeps slowdown - 1 times what the step took, so its steps take slowdown times as long. 1: off."""

    def check(self, p: str) -> None:
        _choice(f"{p}.compile", self.compile, ("auto", "on", "off"))
        if not self.slowdown >= 1:
            raise ConfigError(f"{p}.slowdown", f"must be >= 1 (1: off), got {self.slowdown}")
        if self.micro_batch_size < 0:
            raise ConfigError(f"{p}.micro_batch_size", f"must be >= 0, got {self.micro_batch_size}")
        _choice(f"{p}.outer_state", self.outer_state, ("auto", "device", "host"))
        _choice(f"{p}.companion", self.companion, ("auto", "on", "off"))
        if not 0 <= self.companion_niceness <= 19:
            raise ConfigError(f"{p}.companion_niceness", f"must be 0-19, got {self.companion_niceness}")


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Text files, globs or pre-tokenized .bin files, or one prepared folder (`gossiploco data prepare`: memory-mapped, its vocabulary from its manifest); empty means the built-in corpus (the stdlib's sources)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    batch_size: int = 8
    """Sequences per inner step on each worker."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation (split by document, deterministic)."""
    bin_dtype: str = "uint16"
    """Token dtype of .bin files: uint16 or uint32."""
    vocab_size: int = 0
    """Vocabulary size of .bin data (required for .bin files); byte-level text uses 256."""
    heldout_batch_size: int = 8
    """Sequences in the held-out batch used by the JS monitor (sampled once, reused)."""
    val_batches: int = 4
    """Validation batches (of batch_size sequences) for the validation loss."""
    max_corpus_mb: float = 0.0
    """Read at most this many MB of text (0: no limit)."""
    tokenizer: str = ""
    """Tokenizer of text data: "" (or "bytes") byte-level, 256 ids; else the path of a tokenizer JSON file trained with `gossiploco tokenizer train` (or any with an end-of-text token; with model.init and "", the checkpoint's tokenizer.json). Its SHA-256, not its path, is part of the run id."""

    def check(self, p: str) -> None:
        _positive(f"{p}.seq_len", self.seq_len)
        _positive(f"{p}.batch_size", self.batch_size)
        _positive(f"{p}.heldout_batch_size", self.heldout_batch_size)
        _positive(f"{p}.val_batches", self.val_batches)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"{p}.val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        _choice(f"{p}.bin_dtype", self.bin_dtype, ("uint16", "uint32"))
        if self.vocab_size < 0:
            raise ConfigError(f"{p}.vocab_size", f"must be >= 0, got {self.vocab_size}")
        if self.max_corpus_mb < 0:
            raise ConfigError(f"{p}.max_corpus_mb", f"must be >= 0, got {self.max_corpus_mb}")
        if self.tokenizer not in BYTE_SPECS:
            if not Path(self.tokenizer).is_file():
                raise ConfigError(f"{p}.tokenizer", f"no such file {self.tokenizer!r}; train one with `gossiploco "
                                                    "tokenizer train`, or leave it empty for byte-level tokens")
            if any(path.endswith(".bin") for path in self.paths):
                raise ConfigError(f"{p}.tokenizer", ".bin data is already tokenized; a tokenizer is for text files")


@dataclass
class InnerOptConfig:
    lr: float = 1e-3
    """Peak inner AdamW learning rate (the paper uses 3e-4 at 1.5B, 4e-4 for smaller models)."""
    warmup_steps: int = 50
    """Linear warmup steps; afterwards the rate decays linearly to zero at the last inner step."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the gradient's global L2 norm to this value (0 disables)."""
    synthetic_step_s: float = 0.0
    """Benchmarks only: > 0 makes a network peer sleep this long instead of computing each inner step (the model stays put; communication is real), so network measurements are not distorted by CPU contention."""

    def check(self, p: str) -> None:
        _positive(f"{p}.lr", self.lr)
        if self.synthetic_step_s < 0:
            raise ConfigError(f"{p}.synthetic_step_s", f"must be >= 0, got {self.synthetic_step_s}")
        if self.warmup_steps < 0:
            raise ConfigError(f"{p}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ConfigError(f"{p}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{p}.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        _positive(f"{p}.eps", self.eps)
        if self.grad_clip < 0:
            raise ConfigError(f"{p}.grad_clip", f"must be >= 0, got {self.grad_clip}")


@dataclass
class OuterOptConfig:
    lr: float = 0.7
    """Outer learning rate (DiLoCo: 0.7)."""
    momentum: float = 0.9
    """Outer momentum (DiLoCo: 0.9)."""
    nesterov: bool = True
    """Use Nesterov momentum (the lookahead step); false gives heavy-ball momentum."""

    def check(self, p: str) -> None:
        _positive(f"{p}.lr", self.lr)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"{p}.momentum", f"must be in [0, 1), got {self.momentum}")


@dataclass
class MixConfig:
    kind: str = "identity"
    """Mixing operator: identity, global (all-reduce average) or gossip (pairwise random matching)."""
    blocks: list[str] = field(default_factory=lambda: ["*"])
    """Parameter blocks this operator mixes (names or globs, see gossiploco.blocks); others pass through."""
    state: bool = False
    """Mix1 only: also average the outer momentum (the paper's GlobalM1S variants, appendix B)."""
    mode: str = "fixed"
    """Mix2 only: fixed (always ``blocks``) or adaptive (the consensus monitors grow and shrink the covered blocks round by round, starting from ``blocks``; see [adaptive])."""
    compression: str = "none"
    """What the exchange sends (gossiploco.mixing.compression): none (fp32), bf16, int8 or 4bit (blockwise
    absmax), e3m0 (Streaming DiLoCo's 4-bit float), or, for Mix2, topk (SparseLoCo's chunk-wise top-k).
    Sums are fp32; a group mean quantizes each value at most twice (gossiploco.mixing.compressed). A global
    Mix1 sends its parameters' difference from the last mean (GlobalMix); Mix2 its pseudo-gradient."""
    block_size: int = 4096
    """Values per quantization block (one fp32 scale each) for int8, 4bit and e3m0. On the trainer's
    pseudo-gradients 4096 loses about 5% more than 64 (tests/test_compression.py) for 4x fewer scale bytes."""
    error_feedback: bool = True
    """Mix2 with compression: send the pseudo-gradient plus what earlier rounds' compression lost, keep what this one loses."""
    feedback_decay: float = 1.0
    """The kept residual is added back times this. SparseLoCo's variant decays it (0.95) and drops the outer
    momentum (``outer.momentum = 0``): its accumulator is the momentum (bench/results/compression.md compares)."""
    topk_density: float = 0.02
    """topk: the fraction of each chunk's values sent (the largest magnitudes)."""
    topk_chunk: int = 4096
    """topk: values per chunk (at most 65536: positions are uint16)."""
    topk_bits: int = 2
    """topk: bits per sent value (1, 2, 4 or 8: a sign and 2^(bits-1) magnitudes per chunk)."""
    fragments: int = 1
    """Mix1 only: streamed in this many fragments of about equal size (consecutive parameters), fragment j
    starting at inner step j * inner_steps / fragments: the same mean, a 1/fragments share in flight at a time."""
    fragment_order: str = "forward"
    """Mix1 only: which fragment goes first: forward (the embeddings) or backward (the LM head)."""
    again: bool = True
    """Mix1 only, global: an exchange that failed (a member of its group crashed or left mid-ring) runs once more
    among the group's survivors, under a new leader, while the round has time left for it (gossiploco.mixing.again)."""

    def check(self, p: str) -> None:
        _choice(f"{p}.kind", self.kind, MIX_KINDS)
        _choice(f"{p}.mode", self.mode, ("fixed", "adaptive"))
        if not self.blocks:
            raise ConfigError(f"{p}.blocks", "must name at least one block (use ['*'] for all)")
        _choice(f"{p}.compression", self.compression, COMPRESSIONS)
        if p == "mix1" and self.compression == "topk":
            raise ConfigError(f"{p}.compression", "topk is for Mix2 (a pseudo-gradient with error feedback); "
                              "Mix1 averages parameters: use bf16, int8, 4bit or e3m0")
        if p == "mix1" and self.compression != "none" and self.kind == "gossip":
            raise ConfigError(f"{p}.compression", "a compressed Mix1 sends differences from the last mean every member "
                              "holds, which only a global Mix1 has (gossip partners change every round): use kind = "
                              "\"global\" or compression = \"none\"")
        _positive(f"{p}.fragments", self.fragments)
        _choice(f"{p}.fragment_order", self.fragment_order, FRAGMENT_ORDERS)
        if p == "mix2" and self.fragments != 1:
            raise ConfigError(f"{p}.fragments", "Mix2 blocks on the whole pseudo-gradient at the round's end: only Mix1 streams")
        if not 0 <= self.feedback_decay <= 1:
            raise ConfigError(f"{p}.feedback_decay", f"must be in [0, 1], got {self.feedback_decay}")
        if self.block_size < 1:
            raise ConfigError(f"{p}.block_size", f"must be at least 1, got {self.block_size}")
        if not 0 < self.topk_density <= 1:
            raise ConfigError(f"{p}.topk_density", f"must be in (0, 1], got {self.topk_density}")
        if not 1 <= self.topk_chunk <= 1 << 16:
            raise ConfigError(f"{p}.topk_chunk", f"must be 1 to 65536, got {self.topk_chunk}")
        if self.topk_bits not in TOPK_BITS:
            raise ConfigError(f"{p}.topk_bits", f"must be one of {TOPK_BITS}, got {self.topk_bits}")

    def codec(self) -> Codec:
        """The codec ``compression`` names, with this mix's settings."""
        return build_codec(self.compression, block=self.block_size, density=self.topk_density,
                           chunk=self.topk_chunk, bits=self.topk_bits)


@dataclass
class AdaptiveConfig:
    """How ``mix2.mode = "adaptive"`` moves Mix2's block subset (gossiploco.adaptive). The signal of
    round r is the largest swarm-wide CD_JS measured during it; its recent level is the median of
    the previous ``window`` rounds' signals."""

    order: list[str] = field(default_factory=list)
    """Blocks to add, most needed first (paste the ranking of `gossiploco sensitivity`); empty: layers in order, then norm."""
    grow_factor: float = 1.2
    """Grow when the round's CD_JS exceeds this times its recent level (a spike). 1.5 never fired on one seed of
    bench/adaptive.py (small model) and missed its loss target; 1.2 met it (bench/results/adaptive.md)."""
    calm_factor: float = 1.1
    """A round is calm when its CD_JS is at most this times its recent level (hysteresis: below grow_factor)."""
    shrink_after: int = 3
    """Drop the last added block after this many calm rounds in a row (never below mix2.blocks)."""
    grow_step: int = 1
    """Blocks added per spike."""
    window: int = 5
    """Rounds in the recent level."""
    warmup_rounds: int = 2
    """Rounds observed before the first decision."""

    def check(self, p: str) -> None:
        if not 1.0 <= self.calm_factor < self.grow_factor:
            raise ConfigError(f"{p}.calm_factor", f"need 1 <= calm_factor < grow_factor, got {self.calm_factor} and {self.grow_factor}")
        for name in ("shrink_after", "grow_step", "window", "warmup_rounds"):
            _positive(f"{p}.{name}", getattr(self, name))


@dataclass
class RobustConfig:
    mode: str = "auto"
    """Robust mixing (gossiploco.mixing.robust): on, off, or auto (on in an --open run, where anyone may lie; off in a
    private one, whose members hold the swarm key). On: group means are aggregated by two owners per segment with
    CenteredClip, gossip clips the partner's difference, contributions are screened and repeat offenders excluded."""
    iterations: int = 3
    """CenteredClip steps per aggregate."""
    radius_factor: float = 2.0
    """The clipping radius, in units of the members' median distance from their coordinate-wise median."""
    outlier_factor: float = 3.0
    """A contribution farther than this many median distances from the median fails the screen."""
    min_cosine: float = -0.2
    """A contribution pointing against the median update (cosine below this) fails the screen."""
    weight_cap: float = 2.0
    """A member's weight counts at most this many times the median claimed weight."""
    strikes: int = 3
    """A member that failed the screen in this many of the last ``window`` rounds is excluded."""
    window: int = 5

    def check(self, p: str) -> None:
        _choice(f"{p}.mode", self.mode, ("auto", "on", "off"))
        _positive(f"{p}.iterations", self.iterations)
        for name in ("radius_factor", "outlier_factor", "weight_cap"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{p}.{name}", f"must be > 0, got {getattr(self, name)}")
        if not -1 <= self.min_cosine <= 1:
            raise ConfigError(f"{p}.min_cosine", f"must be in [-1, 1], got {self.min_cosine}")
        _positive(f"{p}.strikes", self.strikes)
        if self.window < self.strikes:
            raise ConfigError(f"{p}.window", f"must be at least strikes = {self.strikes}, got {self.window}")

    def active(self, open_run: bool) -> bool:
        """Whether robust mixing runs: ``mode``, with auto decided by whether the run is open."""
        return self.mode == "on" or (self.mode == "auto" and open_run)


@dataclass
class MonitorConfig:
    every: int = 10
    """Measure consensus every this many inner steps (always also at h = 0 of each round); 0: only at h = 0."""
    js_top_k: int = 100
    """JS distance is computed on the top-k tokens of the averaged model, recomputed each time."""
    val_loss: bool = True
    """Evaluate the averaged model's validation loss at h = 0 of every round."""
    enabled: bool = True
    """Measure during training; false: only the final measurement (for timing runs: in a network peer each measurement is a blocking all-reduce of the parameters)."""

    def check(self, p: str) -> None:
        if self.every < 0:
            raise ConfigError(f"{p}.every", f"must be >= 0, got {self.every}")
        _positive(f"{p}.js_top_k", self.js_top_k)


@dataclass
class TimeoutConfig:
    """Every network wait has its deadline here (the one place to tune them)."""

    exchange_s: float = 120.0
    """Deadline for one collective (all-reduce, gossip swap, monitor average, state download) to complete; past it the exchange fails and mixing falls back to identity."""
    startup_s: float = 60.0
    """How long a starting network peer waits for the other peers to connect before it starts without them."""
    hello_s: float = 5.0
    """How long a starting (or catching-up) peer waits for the others' replies saying which round they are in."""
    grace_s: float = 10.0
    """Grace window of group agreement: an exchange goes on with the peers ready within it; a straggler does identity for that exchange."""
    min_exchange_s: float = 10.0
    """Adaptive deadlines: once a few exchanges of a kind were seen, the next gets adaptive_factor times the slowest recent one, at least this and at most exchange_s."""
    adaptive_factor: float = 4.0
    """Adaptive deadlines: multiple of the slowest recent exchange of the same kind (1 or more)."""
    heartbeat_s: float = 5.0
    """Liveness: a peer whose connection answers no heartbeat for this long is dropped (a frozen process, a dead machine). Must exceed the time one transport.chunk_mb chunk takes on the slowest link (4 MiB: 0.7 s at 50 Mbit/s, 5 s at 7 Mbit/s)."""
    discovery_s: float = 2.0
    """How often a DHT-joined peer refreshes its own announcement and, in a run of up to discovery_records_per_s x
    discovery_s members, reads the run's peers (gossiploco.membership.read_pacing)."""
    discovery_records_per_s: float = 32.0
    """A running peer reads the run's records (every member's, each time) at most this many a second on average:
    every discovery_s up to 64 members by default, every M / this many seconds beyond (31 s at 1,000 peers), and
    discovery_s after the last read when a key of no member knocked (a newcomer whose record it has not read)."""
    announce_ttl_s: float = 20.0
    """Lifetime of a peer's DHT announcement; a peer that stops refreshing it (crashed) disappears after this."""
    reverse_s: float = 20.0
    """How long a reachable peer waits for a peer behind NAT to dial the reverse connection it offered, before it
    relays to that peer instead (its ephemeral ports may be closed: only --port forwarded)."""

    def check(self, p: str) -> None:
        for name in ("exchange_s", "startup_s", "hello_s", "grace_s", "min_exchange_s", "heartbeat_s", "discovery_s",
                     "discovery_records_per_s", "announce_ttl_s", "reverse_s"):
            _positive(f"{p}.{name}", getattr(self, name))
        if self.adaptive_factor < 1:
            raise ConfigError(f"{p}.adaptive_factor", f"must be at least 1, got {self.adaptive_factor}")
        if self.announce_ttl_s <= 2 * self.discovery_s:
            raise ConfigError(f"{p}.announce_ttl_s", f"must exceed twice discovery_s = {2 * self.discovery_s}, got {self.announce_ttl_s}")


@dataclass
class GroupConfig:
    """How large swarms split every exchange into groups (gossiploco.protocol.groups; every peer of a run must use
    the same values)."""

    size: int = 16
    """Swarms of at most this many members exchange as one group (a global Mix1 is the swarm's mean). Larger ones
    split each exchange into random buckets of at most this many members on average, with a leader drawn per
    exchange: nobody waits for a peer outside its group, gossip pairs inside groups, and a global Mix1 becomes the
    group's mean (its rho about 1/size instead of 0: README, "Large swarms")."""

    pairing: str = "bucket"
    """How gossip exchanges (``kind = "gossip"``) find partners. bucket: the group's leader waits for every member
    (up to ``timeouts.grace_s``) and draws a uniform matching over those ready. ready: each member is paired with
    the next of its group to become ready, so nobody waits for the group's slowest member (``protocol.pairing``:
    uniform when the order of arrival is random, biased toward similar speeds when speeds differ for good). Not the
    default: without bucket pairing's barrier, members start their next round apart, and unless rounds keep to a
    shared clock (``[round] budget = "time"`` with ``clock = "shared"``) the next Mix1 leaves the late ones out
    (measured in the simulator: README, "Large swarms")."""

    def check(self, p: str) -> None:
        if self.size < 2:
            raise ConfigError(f"{p}.size", f"must be at least 2, got {self.size}")
        if self.pairing not in ("ready", "bucket"):
            raise ConfigError(f"{p}.pairing", f"must be ready or bucket, got {self.pairing!r}")

    def paired(self, kinds: dict[str, str]) -> frozenset[str]:
        """The labels (of ``kinds``: label -> mixer kind) whose exchanges pair as members become ready."""
        if self.pairing != "ready":
            return frozenset()
        return frozenset(label for label, kind in kinds.items() if kind == "gossip")


@dataclass
class TransportConfig:
    """The ZeroMQ data plane of network peers (every peer of a run must use the same values)."""

    chunk_mb: float = 4.0
    """Payload per message; large tensors stream as chunks of this size."""
    max_message_mb: float = 64.0
    """Messages larger than this are rejected unread (must exceed chunk_mb)."""
    ring_order: str = "topology"
    """topology: rings put peers behind NAT between reachable ones (fewer relayed hops); id: by peer id."""
    links_idle_s: float = 0.0
    """0: a connection to every member (a full mesh). Above 0: links on demand: a member this peer dials (directly,
    or through a relay) gets this peer's sockets when something is sent to it (Mix2's bucket at the round's start)
    and loses them after this many seconds with nothing sent either way; members on a reverse path (behind NAT,
    dialing this peer's offered ports) keep theirs (``transport.zmq_links``)."""
    links_cap: int = 0
    """With links on demand: the most links a peer keeps; past it, the least recently used link unused for 1 s is
    closed (no failure; none such: the peer goes over until one is). 0: twice ``[groups] size`` less two, the other
    members of two buckets (a round's Mix2 bucket is linked ahead while the last round's links are still up), which
    at 1,000 simulated peers held a peer's links to 2x a 16-peer swarm's at no measured cost (README, "Large
    swarms")."""

    def links_kept(self, group_size: int) -> int:
        """The most links a peer keeps on demand (``links_cap``, 0: from the group size)."""
        return self.links_cap or 2 * (group_size - 1)

    def check(self, p: str) -> None:
        _positive(f"{p}.chunk_mb", self.chunk_mb)
        if self.links_idle_s < 0:
            raise ConfigError(f"{p}.links_idle_s", f"must be 0 (a full mesh) or positive, got {self.links_idle_s}")
        if self.links_cap < 0:
            raise ConfigError(f"{p}.links_cap", f"must be 0 (twice the group size less two) or positive, got "
                                                f"{self.links_cap}")
        if self.ring_order not in ("topology", "id"):
            raise ConfigError(f"{p}.ring_order", f"must be topology or id, got {self.ring_order!r}")
        if self.max_message_mb <= self.chunk_mb + 1:
            raise ConfigError(f"{p}.max_message_mb", f"must exceed chunk_mb + 1 = {self.chunk_mb + 1}, got {self.max_message_mb}")


@dataclass
class CheckpointConfig:
    """When a run writes checkpoints to OUT/checkpoints/ (gossiploco.checkpoint). Each peer's own choice: not
    part of the run id, and a resumed run may change it."""

    every: int = 1
    """Write a checkpoint every this many rounds (at the round's start); 0: only at the end and on Ctrl+C / SIGTERM."""
    keep: int = 2
    """Checkpoints kept (the newest); older ones are deleted once a newer one is complete."""
    enabled: bool = True
    """False: no checkpoints at all (benchmarks); the run cannot be resumed."""

    def check(self, p: str) -> None:
        if self.every < 0:
            raise ConfigError(f"{p}.every", f"must be >= 0, got {self.every}")
        _positive(f"{p}.keep", self.keep)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(name, f"must be > 0, got {value}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}; got {value!r}")

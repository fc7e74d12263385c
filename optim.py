"""AdamW that does not lose small updates when the weights themselves are bf16.

Why: full fine-tuning Llama-3-8B on one 141 GB GPU leaves no room for fp32 master weights (8B x (4 weights +
4 grads + 8 Adam moments) = 128 GB before any activation). So the weights stay bf16 (16 GB), the Adam moments
stay fp32 (64 GB), and a 16-bit compensation buffer (16 GB) keeps what bf16 cannot hold.

The problem: bf16 has 8 bits of mantissa, so neighbouring values of a weight w are about |w| * 2^-8 apart. An
update u smaller than half that spacing (half an ulp) is rounded away entirely: w + u == w. At lr 1e-6 and
|w| ~ 0.02 every Adam step (|u| <= ~lr) is such an update, and plain bf16 AdamW does not train at all.

The fix, Kahan summation: keep the part of each update that rounding dropped in a buffer `comp` and add it to
the next update; w + comp is then the true weight (the update, written out: kernels/adamw.py). comp is at most half
an ulp of w, so it needs precision, not range: we keep it in fp16 (11 significant bits, 3 more than bf16, same 2
bytes) even for bf16 weights: a bf16 comp would itself round away the low bits of what it keeps, an error that
grows with |w| (the norm weights, |w| ~ 1, lose the most). The price: fp16 resolves a small comp only to its floor
of 2^-24 ~ 6e-8 (subnormals), a few % of a 1e-6 update; fine for lr >~ 1e-6, and still better than bf16 above
|w| ~ 2^-7. fp32 parameters take the plain AdamW update (exactly as torch.optim.AdamW) and get no `comp` buffer.

The idea is "Kahan summation for bf16 training" from Zamirai et al. 2020, "Revisiting BFloat16 Training"; the
optimi library (B. Warner) ships Kahan-compensated optimizers built on it. This code is our own.

Also here, for train.py and bench/e2e.py: make_optimizer (either AdamW), and Update, which decides when the update
happens (after backward, clipped, or inside backward: step_in_backward) so that the training loop has one path.
"""
import contextlib
import math
import weakref

import torch

import kernels

OPTIMIZERS = ("adamw", "adamw_kahan", "adamw8bit")
KAHAN_OPTIMIZERS = ("adamw_kahan", "adamw8bit")  # compensated updates (bf16 weights) and step_param (in backward)


def param_groups(model, weight_decay):
    """AdamW's parameter groups: weight decay on the matrices (embeddings, projections), none on the norm weights."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def make_optimizer(name, model, lr, betas, weight_decay, fused=False, offload=()):
    """AdamW over the model's param_groups: plain AdamW ("adamw": torch's; fused, on CUDA: our kernel, AdamWKahan,
    which takes fp32 weights exactly so and folds the clipping into its read of each gradient; torch's fused kernel
    for FSDP's DTensor shards), or AdamWKahan ("adamw_kahan": for bf16 weights), or AdamW8bit ("adamw8bit": the same
    with 8-bit moments; offload: the parameters whose state it keeps in host memory, offloaded_params)."""
    groups = param_groups(model, weight_decay)
    if offload and name != "adamw8bit":
        raise ValueError(f"offload: the optimizer state goes to host memory with adamw8bit only, not {name!r}")
    if name == "adamw8bit":
        return AdamW8bit(groups, lr=lr, betas=betas, offload=offload)
    if name == "adamw_kahan":
        return AdamWKahan(groups, lr=lr, betas=betas)
    if name == "adamw":
        if fused and not any(hasattr(p, "full_tensor") for p in model.parameters()):
            return AdamWKahan(groups, lr=lr, betas=betas)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
    raise ValueError(f"optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")


def offloaded_params(model, share):
    """The parameters whose AdamW8bit state goes to host memory: the last ones, in model order, that make up `share`
    (0 .. 1) of the elements. The first ones (the embedding, the first blocks) keep theirs on the GPU: backward
    updates them last, when no compute is left to hide their copies under."""
    if not 0 <= share <= 1:
        raise ValueError(f"offload share {share}: the share of the optimizer state in host memory, from 0 to 1")
    params, total, kept = list(model.parameters()), sum(p.numel() for p in model.parameters()), 0
    for i, p in enumerate(params):
        if kept + p.numel() > (1 - share) * total:
            return params[i:]
        kept += p.numel()
    return []


def offloaded_bytes(params, min_8bit_size=4096):
    """Host memory the AdamW8bit state of `params` takes offloaded: per element an int8 and a uint8 code, fp32
    scales per 64, and an fp16 comp for 16-bit weights (4.125 bytes per bf16 parameter); smaller tensors stay on
    the GPU."""
    return int(sum(p.numel() * (2 + 8 / kernels.common.ADAMW8BIT_BLOCK + 2 * (p.element_size() == 2))
                   for p in params if p.numel() >= min_8bit_size))


def host_memory_available():
    """Bytes of host memory the kernel says a new allocation can take (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def host_memory_error(params, available):
    """Why the offloaded state of `params` cannot fit in `available` bytes of host memory (None: it fits, or
    nothing is known): pinned pages cannot be swapped out, so this is checked before the first step."""
    need = offloaded_bytes(params)
    if available is not None and need > available:
        return (f"the offloaded optimizer state needs {need / 1e9:.1f} GB of pinned host memory and this machine has "
                f"{available / 1e9:.1f} GB available: lower optimizer_offload (keep more state on the GPU, with "
                "more checkpoint_layers to make room) or free host memory")
    return None


class Update:
    """When the weights take their step. The training loop reads the same whatever the answer:

        for each micro-step: loss = ...; stop unless update.safe_to_backward(loss); loss.backward()
        grad_norm = update.grad_norm()   # the step's global gradient norm, a device tensor (no sync)
        norm = grad_norm.item()          # a sync; stop on a non-finite loss or norm
        update.clip_and_step(norm)

    After backward (in_backward=False): backward sums the gradients of every micro-step; grad_norm() measures them,
    clip_and_step() scales them to a global norm of at most grad_clip (0: no clipping), steps and frees them.
    Inside backward (in_backward=True, step_in_backward below): backward updates each weight as soon as its gradient
    is complete and frees the gradient; grad_norm() is what the hooks added up, clip_and_step() has nothing left
    to do. The weights have then changed before the check after backward: safe_to_backward() checks the loss first.
    """

    def __init__(self, optimizer, params, grad_clip=0.0, in_backward=False):
        if in_backward and grad_clip:
            raise ValueError("in_backward: no gradient clipping, the global norm is known only after every update")
        self.optimizer, self.params, self.grad_clip, self.in_backward = optimizer, list(params), grad_clip, in_backward
        self.grad_sq = step_in_backward(optimizer) if in_backward else None
        self.norm = None  # grad_norm() of this step, as clip_and_step() needs it (under FSDP: the DTensor)

    def safe_to_backward(self, loss):
        """False when backward would apply a non-finite loss to the weights (in_backward only; a host sync)."""
        return not self.in_backward or math.isfinite(loss.item())

    def grad_norm(self):
        """The L2 norm of all of this step's gradients, a 0-d tensor, the same on every rank (FSDP: gathered from
        the shards); call it once per step, after the last backward."""
        if self.in_backward:
            self.optimizer.wait_for_updates()
            return pop_grad_sq(self.grad_sq, self.params[0].device).sqrt()
        self.norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        return self.norm.full_tensor() if hasattr(self.norm, "full_tensor") else self.norm

    def clip_and_step(self, host_norm=None):
        """Clip the gradients to grad_clip by the norm grad_norm() measured, step, free them (after backward only).
        Clipping is g * min(1, grad_clip / (norm + 1e-6)): torch's clip_grad_norm_ split in its two halves; our
        optimizers (AdamWKahan, AdamW8bit) take that factor into their kernels instead, which saves a pass that
        reads and writes every gradient (the factor is the same value; the product is in fp32).
        host_norm: that norm as a float, where the caller has read it anyway (train.py does, to stop on NaN): when
        the scale is clearly above 1 (by 1e-5, far above fp32's rounding of it), min(1, ...) is exactly 1 and the
        pass over every gradient is skipped, the same bits."""
        if self.in_backward:
            self.optimizer.wait_for_updates()  # (grad_norm() did; the next forward must not start before them)
            return
        if not self.grad_clip or (host_norm is not None and self.grad_clip / (host_norm + 1e-6) > 1 + 1e-5):
            self.optimizer.step()
        elif isinstance(self.optimizer, AdamWKahan):  # the factor is multiplied in as its kernels read each gradient
            self.optimizer.step(grad_scale=torch.clamp(self.grad_clip / (self.norm + 1e-6), max=1.0).float())
        else:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, self.norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class AdamWKahan(torch.optim.Optimizer):
    """AdamW for parameters of any dtype: fp32 moments, and Kahan-compensated updates for bf16 / fp16 weights.

    State per parameter: step (a CPU scalar tensor, as in torch.optim.AdamW), exp_avg and exp_avg_sq (fp32), and
    for bf16 / fp16 parameters comp (fp16). Each parameter is updated on its own by kernels.adamw_step: on CUDA one
    fused Triton kernel that reads and writes every tensor once (26 bytes per bf16 parameter), on the CPU the
    plain-torch reference, whose fp32 temporaries are then the size of one tensor, not of the whole model.
    step_param is public so that step_in_backward (below) can update each parameter as soon as its gradient is ready.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None, grad_scale=None):
        """One step of every parameter with a gradient; grad_scale (one fp32 value on their device, or None)
        multiplies every gradient as the kernel reads it (Update's clipping, without a pass of its own)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_param(p, group, grad_scale=grad_scale)
        return loss

    @torch.no_grad()
    def step_param(self, p, group, grad_sq=None, grad_scale=None):
        """One AdamW step of parameter p (of param group `group`) with the gradient in p.grad (times grad_scale);
        grad_sq (a list, or None) gets the partial sums of its squares appended, by the kernel that reads it anyway
        (pop_grad_sq)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            if p.dtype in (torch.bfloat16, torch.float16):
                state["comp"] = torch.zeros_like(p, dtype=torch.float16)  # fp16 even for bf16: see above
        state["step"] += 1
        beta1, beta2 = group["betas"]
        kernels.adamw_step(p, p.grad, state["exp_avg"], state["exp_avg_sq"], state.get("comp"), group["lr"],
                           beta1, beta2, group["eps"], group["weight_decay"], int(state["step"].item()), grad_sq,
                           grad_scale)

    def wait_for_updates(self):
        """The steps ran on the current stream: nothing to wait for (AdamW8bit's offload queues them elsewhere)."""

    def wait_for_state(self):
        """The state is where the steps wrote it: nothing to wait for (AdamW8bit's offload copies it back)."""

    def load_state_dict(self, state_dict):
        # Optimizer.load_state_dict casts every floating state tensor to its parameter's dtype and moves all of
        # them to its device, which would round the fp32 moments of a bf16 parameter to bf16 (no exact resume) and
        # bring offloaded state onto the GPU: it loads the param groups only, place() puts each saved tensor.
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            saved = state_dict["state"].get(i, {})
            for key, value in saved.items():
                self.state[p][key] = (value.clone() if key == "step"  # (a CPU scalar, as torch keeps it)
                                      else self.place(p, value, "exp_avg_scale" in saved))  # in its saved dtype

    def place(self, p, value, coded):
        """A loaded state tensor of p where it lives: on p's device (coded: p's moments are 8-bit codes)."""
        return value.to(p.device)


class AdamW8bit(AdamWKahan):
    """AdamWKahan with its two moments stored in 8 bits: 1 + 1 bytes per parameter instead of 4 + 4.

    For Llama-3-8B in bf16 that is 17 GB of moments instead of 64: weights 16 + moments 17 + Kahan comp 16 = 49 GB,
    which leaves room for activations on an 80 GB card. Each moment is coded per block of 64 elements of the flat
    tensor, with the block's max as an fp32 scale and a companded 8-bit code per element; sqrt(v) is stored rather
    than v (the codes, why they round stochastically, the guard against a vanishing v, and the measurements behind them:
    kernels/adamw8bit.py).
    Everything else is AdamWKahan's: the update (in fp32, on the decoded moments), Kahan-compensated bf16 / fp16
    weights with an fp16 comp, plain updates of fp32 weights; one fused Triton kernel per parameter on CUDA.

    State per parameter with at least min_8bit_size elements: step, exp_avg (int8 codes of m, p's shape),
    exp_avg_scale (fp32, one per block), exp_avg_sq (uint8 codes of sqrt(v)), exp_avg_sq_scale (fp32), and comp
    (fp16) for bf16 / fp16 weights. Smaller tensors (the default 4096: below it a tensor is a handful of blocks and
    its moments are negligible; no tensor of Llama-3-8B is that small) keep AdamWKahan's fp32 moments, as do fp64
    weights. Which kind a parameter has is decided at its first step and read back from its state afterwards, so
    a loaded state dict or checkpoint continues as it was saved. step_param works with step_in_backward.
    offload: the parameters whose 8-bit state (codes, scales, comp) lives in pinned host memory and streams through
    the GPU for each step (StateStream), to the same results.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, min_8bit_size=4096,
                 offload=()):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.min_8bit_size = min_8bit_size
        self.offload = set(offload)  # the parameters whose 8-bit state lives in host memory
        self.stream = None  # offload: the StateStream, made at the first step (it needs the parameters' device)

    @torch.no_grad()
    def step_param(self, p, group, grad_sq=None, grad_scale=None):
        """One AdamW step of parameter p (of param group `group`) with the gradient in p.grad (grad_sq, grad_scale:
        as AdamWKahan's). Offloaded, the step is only queued: wait_for_updates() before the compute stream reads p,
        wait_for_state() before the host reads the state."""
        state = self.state[p]
        if not state and p.numel() >= self.min_8bit_size and p.dtype != torch.float64:
            n_blocks = -(-p.numel() // kernels.common.ADAMW8BIT_BLOCK)
            where = dict(device="cpu", pin_memory=p.is_cuda) if p in self.offload else dict(device=p.device)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.int8, **where)
            state["exp_avg_scale"] = torch.zeros(n_blocks, dtype=torch.float32, **where)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.uint8, **where)
            state["exp_avg_sq_scale"] = torch.zeros(n_blocks, dtype=torch.float32, **where)
            if p.dtype in (torch.float16, torch.bfloat16):
                state["comp"] = torch.zeros(p.shape, dtype=torch.float16, **where)
        if "exp_avg_scale" not in state:
            return super().step_param(p, group, grad_sq, grad_scale)  # fp32 moments
        state["step"] += 1
        beta1, beta2 = group["betas"]
        hyper = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], int(state["step"].item()))
        if p in self.offload:
            self.stream = self.stream or StateStream(p.device)
            return self.stream.step(p, state, hyper, grad_sq, grad_scale)
        kernels.adamw8bit_step(p, p.grad, *(state.get(k) for k in STATE_8BIT), *hyper, grad_sq, grad_scale=grad_scale)

    def place(self, p, value, coded):
        """As AdamWKahan's; offloaded, coded state (codes, scales, comp) goes to pinned host memory."""
        if coded and p in self.offload:
            return value.cpu().pin_memory() if p.is_cuda else value.cpu()
        return value.to(p.device)

    def wait_for_updates(self):
        """Make the current stream wait for every step queued so far (offload; otherwise they ran on it)."""
        if self.stream is not None:
            self.stream.wait_for_updates()

    def wait_for_state(self):
        """Block the host until the offloaded state is all back in host memory (before reading or saving it)."""
        if self.stream is not None:
            self.stream.wait_for_state()

    def state_dict(self):
        self.wait_for_state()
        return super().state_dict()

    @torch.no_grad()
    def step(self, closure=None, grad_scale=None):
        loss = super().step(closure, grad_scale)
        self.wait_for_updates()
        return loss


STATE_8BIT = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "comp")  # adamw8bit_step's order


class StateStream:
    """AdamW8bit(offload=params): the 8-bit moments, their scales and the Kahan comp live in pinned host memory (4.1
    bytes per parameter) and pass through the GPU in pieces of PIECE elements while backward runs on.

    A piece goes through a ring of SLOTS GPU buffers on three side streams: copy in (host to GPU), step (the fused
    kernel, once the gradient is complete), copy out (GPU to host); a slot is reused once its copy out is done, so
    with three slots one piece comes in, one is stepped and one goes out at once, under the compute stream's work.
    The pieces are stepped exactly as the whole parameter would be (adamw8bit_step's `start`; PIECE is a multiple
    of the kernel's program tile, so on the GPU even the gradient norm's partial sums are the same): offloaded and
    resident training give the same weights to the bit. The gradient stays allocated until its piece's step has run
    (record_stream); the host thread waits when the gradients queued exceed MAX_QUEUED_BYTES, so a slow link
    costs time, not memory. The weights change on the step stream: wait_for_updates() before the next forward; the
    host state is whole again after wait_for_state() (checkpoint.optimizer_tensors and state_dict() call it).
    Off CUDA the same pieces run one after the other on the CPU (what the tests compare).
    The idea is ZeRO-Offload's (Ren et al. 2021) and torchtune's offloaded optimizer state; the code is our own.
    """
    PIECE = 1 << 25  # elements: a slot holds 4.1 bytes each, 132 MiB
    SLOTS = 3
    MAX_QUEUED_BYTES = 2 << 30

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.slots, self.turn = [{} for _ in range(self.SLOTS)], 0
        self.freed = [None] * self.SLOTS  # per slot: the event after its last copy out
        self.last_copy_out = {}  # per parameter: the event after its state's last copy out (its next copy in waits)
        self.queued = []  # (event after the step of a parameter's last piece, its gradient's bytes)
        if self.cuda:
            self.copy_in, self.stepper, self.copy_out = (torch.cuda.Stream(device) for _ in range(3))

    def _slot(self, state):
        """The next slot of the ring: a GPU buffer per state tensor, made at its first use (fp32 weights have no
        comp), of PIECE elements (scales: one per block)."""
        i, self.turn = self.turn, (self.turn + 1) % self.SLOTS
        slot = self.slots[i]
        for k in (k for k in STATE_8BIT if k in state and k not in slot):
            size = self.PIECE // kernels.common.ADAMW8BIT_BLOCK if k.endswith("scale") else self.PIECE
            slot[k] = torch.empty(size, dtype=state[k].dtype, device=self.device)
        return i, slot

    def step(self, p, state, hyper, grad_sq, grad_scale=None):
        """Queue the AdamW8bit step of p (its gradient p.grad, times grad_scale; state: host tensors; hyper: lr,
        beta1, beta2, eps, weight_decay, step) piece by piece."""
        grad, n, block = p.grad, p.numel(), kernels.common.ADAMW8BIT_BLOCK
        self._bound_queue(grad.numel() * grad.element_size())
        grad_ready = self._event()  # on the compute stream: the gradient is complete
        n_sums = len(grad_sq or [])
        for start in range(0, n, self.PIECE):
            end = min(n, start + self.PIECE)
            pieces = {k: state[k].view(-1)[start // block: -(-end // block)] if k.endswith("scale")
                      else state[k].view(-1)[start:end] for k in STATE_8BIT if k in state}
            i, slot = self._slot(state)
            slot = {k: slot[k][:piece.numel()] for k, piece in pieces.items()}
            with self._on("copy_in", self.freed[i], self.last_copy_out.get(p)):
                for k, piece in pieces.items():
                    slot[k].copy_(piece, non_blocking=True)
                copied_in = self._event()
            with self._on("stepper", copied_in, grad_ready):
                kernels.adamw8bit_step(p.view(-1)[start:end], grad.view(-1)[start:end],
                                       *(slot.get(k) for k in STATE_8BIT), *hyper, grad_sq, start, grad_scale)
                stepped = self._event()
            with self._on("copy_out", stepped):
                for k, piece in pieces.items():
                    piece.copy_(slot[k], non_blocking=True)
                self.freed[i] = self._event()
        self.last_copy_out[p] = self.freed[i]
        if self.cuda:
            grad.record_stream(self.stepper)  # freed (p.grad = None) now, reused only once the steps have run
            if grad_scale is not None:
                grad_scale.record_stream(self.stepper)  # (the caller's, dropped after step())
            for t in (grad_sq or [])[n_sums:]:
                t.record_stream(torch.cuda.current_stream(self.device))  # (made on the step stream, read after)
            self.queued.append((stepped, grad.numel() * grad.element_size()))

    def _bound_queue(self, more):
        while self.queued and sum(b for _, b in self.queued) + more > self.MAX_QUEUED_BYTES:
            self.queued.pop(0)[0].synchronize()
        self.queued = [(e, b) for e, b in self.queued if not e.query()]

    def _on(self, name, *events):
        """Context: run on side stream `name` after `events` (None: nothing to wait for); off CUDA, run here."""
        if not self.cuda:
            return contextlib.nullcontext()
        stream = getattr(self, name)
        for event in events:
            if event is not None:
                stream.wait_event(event)
        return torch.cuda.stream(stream)

    def _event(self):
        """An event recorded on the current stream (None off CUDA)."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None

    def wait_for_updates(self):
        """The current stream waits for the steps queued so far (the host does not)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stepper)

    def wait_for_state(self):
        """The host waits until every piece is back in host memory (copy out runs after its step)."""
        if self.cuda:
            self.copy_out.synchronize()


def pop_grad_sq(grad_sq, device):
    """The squared norm of the gradients whose steps appended their partial sums to grad_sq (a list of 1-D fp32
    tensors, step_in_backward's), a 0-d fp32 tensor on device; grad_sq is emptied for the next step. One sum over
    all of them, not one per parameter: two launches per step instead of two per parameter."""
    total = torch.cat(grad_sq).sum() if grad_sq else torch.zeros((), dtype=torch.float32, device=device)
    grad_sq.clear()
    return total


def step_in_backward(optimizer) -> list:
    """Make backward itself run the optimizer: each parameter takes its AdamW step the moment its gradient is
    complete, and the gradient is freed right after. Returns the list to which every parameter's step appends the
    partial sums of its gradient's squares (made by the AdamW kernel as it reads the gradient: no second pass over
    it): after backward, pop_grad_sq(it) is the squared global gradient norm, for logging, and empties it.

    What it buys: gradients never coexist. A plain step holds every gradient at once until optimizer.step() (16 GB
    for an 8B model in bf16); here only the gradients backward is still summing up are alive: about a block's worth,
    plus, with tied embeddings, the shared (vocab, dim) gradient from the loss to the embedding.
    What it costs: the global gradient norm is known only after every parameter has stepped, so there is no
    gradient clipping by it; a gradient is consumed at the end of each backward, so no gradient accumulation across
    micro-steps either; and a NaN check can only look at the loss before backward (a non-finite gradient has been
    applied by the time it could be seen). Update (above) takes care of all three; train.py refuses the settings.

    Only AdamWKahan (AdamW8bit is one) has step_param; it handles fp32 parameters too (plain AdamW update). The idea is
    torchtune's "optimizer in backward", built on Tensor.register_post_accumulate_grad_hook: the hook runs once per
    backward, after the gradients of every use of the parameter (tied embeddings: both) have been summed into .grad.
    Call it once per model: the hooks stay on the parameters for good (a second call would step every parameter
    twice). Set the learning rate in optimizer.param_groups before backward, as it is read when each parameter steps.
    A compiled model (torch.compile) makes all its gradients in one backward node before any hook runs: correct,
    but all gradients then coexist (train.py refuses the combination).
    """
    assert isinstance(optimizer, AdamWKahan), "step_in_backward needs AdamWKahan (its step_param)"
    grad_sq = []
    # The hooks live on the parameters and must not keep the optimizer alive: parameter -> hook -> optimizer ->
    # parameter is a cycle through C++ that Python's garbage collector cannot see, so dropping the model and the
    # optimizer would free neither.
    optimizer_ref = weakref.ref(optimizer)

    def make_hook(group_index):
        @torch.no_grad()
        def hook(p):
            opt = optimizer_ref()
            if opt is None:
                raise RuntimeError("the optimizer of step_in_backward was deleted while its model still trains")
            opt.step_param(p, opt.param_groups[group_index], grad_sq)  # (appends p.grad's partial sums of g^2)
            p.grad = None
        return hook

    for i, group in enumerate(optimizer.param_groups):
        hook = make_hook(i)
        for p in group["params"]:
            p.register_post_accumulate_grad_hook(hook)
    return grad_sq

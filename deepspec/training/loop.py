"""The training loop: batch -> forward and loss -> engine.backward -> engine.step -> log -> validate -> checkpoint.

`train(session)` runs a `Session` (deepspec.training.session) to its last step: `train` is the run (steps, logging,
validation, checkpoints, how it ends) and `train_step` one optimizer step over its micro-batches. The rare paths
have their own helpers: the non-finite guards (`_check_losses`, `_check_gradients`: deepspec.training.guards), a
SIGTERM (`_terminated`) and the end of a run (`_finish`: the last validation and checkpoint, then the hooks).
Everything that is not the loop itself (DeepSpeed set-up, checkpoints, data order, metrics, log sinks) lives in
its own module.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from deepspec.losses.objectives import StepResult
from deepspec.training.guards import check_grad_norm_finite, check_losses_finite
from deepspec.training.log import MetricLogger, ProgressBar, save_resolved_config
from deepspec.training.session import Session
from deepspec.training.validation import run_decode_validation, run_validation
from deepspec.utils.phases import PhaseTimer, phase
from deepspec.utils.termination import StopRequest, Terminated

log = logging.getLogger(__name__)


@dataclass
class StepTotals:
    """One optimizer step, summed over its micro-batches and the ranks."""

    loss: float  # the mean loss of the step's micro-batches on every rank
    tokens: int
    anchors: int
    seconds: float  # wall clock
    cpu_s: float  # this process's CPU time: fair on a shared machine
    stop_agreed: bool  # a SIGTERM reached some rank: every rank stops after this step
    last: StepResult  # of the last micro-batch (its loss parts are logged)


@dataclass
class RunMarks:
    """The run's newest checkpoint and validation."""

    checkpoint: Path | None = None
    validated_step: int | None = None
    validation: dict = field(default_factory=dict)


def train(s: Session, stop: StopRequest | None = None) -> dict:
    """Run `s` from its state's step to `s.total_steps`; returns the run's summary. `stop`: set by a SIGTERM
    (`deepspec.training.run` installs the handler): every rank stops after the same step, saved."""
    stop = stop or StopRequest()
    t, state, p = s.cfg.trainer, s.state, s.placement
    logger = open_logger(s)
    bar = ProgressBar(s.total_steps, state.step, enabled=t.progress_bar and p.rank == 0)
    s.engine.train()
    if p.device.type == "cuda":  # peak_mem_mb below is this run's (the target's weights included)
        torch.cuda.reset_peak_memory_stats(p.device)
    marks = RunMarks()
    if t.val_at_start and state.step == 0 and s.total_steps > 0:
        marks.validation = validate(s, logger)
    order, order_epoch = None, None
    notes = LossCheckpointNotes(enabled=p.rank == 0)
    timer = PhaseTimer() if t.phase_times else None  # trainer.phase_times: where each step's CPU time goes
    ending = "finished"
    with timer or nullcontext():
        while state.step < s.total_steps:
            if state.batch_in_epoch >= s.data.steps_per_epoch:  # epoch boundary: new order, new anchors
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if order_epoch != state.epoch:
                with phase("data"):
                    order, order_epoch = s.data.epoch_order(state.epoch), state.epoch
            step = train_step(s, order, stop.requested, notes)
            log_step(s, logger, bar, step, timer)
            if step.stop_agreed:  # a SIGTERM reached some rank: all stop after this same step, saved below
                ending = "terminated"
                break
            if state.step % t.val_every == 0:
                with phase("validation"):
                    marks.validation = validate(s, logger)
                marks.validated_step = state.step
            if s.checkpointer.due(state.step):
                marks.checkpoint = s.checkpointer.save(s.engine, state, s.average)
            if s.cfg.faults.should_stop(state.step):
                # Fault injection: leave exactly as a kill would, with only the periodic checkpoints on disk.
                log.warning("faults.stop_after=%d reached: stopping as if killed", s.cfg.faults.stop_after)
                ending = "stopped"
                break
    bar.close()
    if ending == "terminated":
        raise _terminated(s, logger, s.checkpointer.save(s.engine, state, s.average), "")
    if ending == "finished":
        _finish(s, logger, marks, stop)
    logger.close()
    return {"step": state.step, "stopped": ending == "stopped",
            "checkpoint": str(marks.checkpoint) if marks.checkpoint else None, "validation": marks.validation,
            "out_dir": str(s.out_dir)}


def train_step(s: Session, order: list[int], stop_requested: bool, notes: LossCheckpointNotes) -> StepTotals:
    """One optimizer step of the epoch's `order`: every micro-batch's forward, loss and backward, the guards, the
    update. `stop_requested`: this rank got a SIGTERM (the ranks agree on it with the step's scalars)."""
    state, data, engine, p = s.state, s.data, s.engine, s.placement
    grad_accum = s.plan.grad_accum_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    losses, tokens, anchors = [], 0, 0
    # Gradient accumulation: each micro step's backward adds into the same gradient buffers (DeepSpeed scales each
    # loss by 1/grad_accum); engine.step() only updates weights at the accumulation boundary, where the gradients are
    # reduced across ranks. Every rank runs the same number of micro steps.
    for micro_step in range(grad_accum):
        with phase("data"):
            ids = data.micro_batch_ids(order, state.batch_in_epoch, micro_step, p.rank, p.world_size)
            batch = data.collate(ids, state.epoch)
            counts = data.counts(batch)  # from the batcher's host-side stats: no device read
        with phase("target"):
            batch = batch.to(p.device, p.dtype)
        with phase("loss"):
            loss, result = engine(batch)  # drafter forward + objective (session.TrainingModule)
        notes.update(result, state.step + 1)
        losses.append(loss.detach())
        tokens, anchors = tokens + counts.tokens, anchors + counts.anchors
        with phase("backward"):
            engine.backward(loss)  # a non-finite loss still runs: every rank stays in the collectives
        if micro_step == grad_accum - 1:
            with phase("guards"):
                loss_sum, tokens, anchors, stop_agreed = _check_losses(s, order, losses, tokens, anchors,
                                                                       stop_requested)
        with phase("optimizer"):
            engine.step()
    if s.average is not None:
        with phase("optimizer"):
            s.average.update()
    state.step += 1
    state.batch_in_epoch += 1
    with phase("guards"):
        _check_gradients(s, order)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    state.train_cpu_s += cpu_s
    state.samples_seen += s.cfg.trainer.global_batch_size
    state.tokens_seen += int(tokens)
    return StepTotals(loss=loss_sum / (grad_accum * p.world_size), tokens=tokens, anchors=anchors, seconds=seconds,
                      cpu_s=cpu_s, stop_agreed=stop_agreed, last=result)


def log_step(s: Session, logger: MetricLogger, bar: ProgressBar, step: StepTotals, timer: PhaseTimer | None) -> None:
    """The progress bar each step; a metrics record every `trainer.log_every` steps and at the last one."""
    state, device = s.state, s.placement.device
    log_now = state.step % s.cfg.trainer.log_every == 0 or state.step == s.total_steps
    # The phases since the previous record: this record's logging is in the next one's.
    phases = timer.take() if timer is not None and log_now else {}
    with phase("logging"):
        bar.update(step.loss, step.tokens / step.seconds, step.anchors / step.seconds)
        if log_now:
            memory = {"peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}
            logger.log({"loss": step.loss, "lr": s.engine.get_lr()[0], "epoch": state.epoch,
                        "tokens_per_s": step.tokens / step.seconds, "anchors_per_s": step.anchors / step.seconds,
                        "step_ms": 1000 * step.seconds, "step_cpu_s": step.cpu_s, "tokens_seen": state.tokens_seen,
                        "train_cpu_s": state.train_cpu_s, **memory, **phases,
                        **{f"loss_{k}": v for k, v in step.last.loss.parts.items()}}, state.step, "train")


class LossCheckpointNotes:
    """`loss.checkpoint=auto` decides per micro-batch size: rank 0 logs the decision whenever it changes."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.checkpointed: bool | None = None

    def update(self, result: StepResult, step: int) -> None:
        decision = result.terms.checkpoint
        if decision is not None and decision.checkpoint != self.checkpointed and self.enabled:
            self.checkpointed = decision.checkpoint
            log.info("step %d: %s", step, decision.note)


def _step_scalars(losses: list[torch.Tensor], tokens: int, anchors: int, rank: int, world: int, stop: bool = False
                  ) -> tuple[float, int, int, list[float], bool]:
    """(loss sum, tokens, anchors, non-finite-loss flag per [rank * micro steps + micro step], whether any rank was
    asked to stop (`stop`: a SIGTERM)) of an optimizer step, summed over ranks: one device-to-host read and one
    small all-reduce per optimizer step, so every rank takes the same decision after the same step."""
    loss_M = torch.stack(losses).double()
    flags = torch.zeros(world * loss_M.shape[0], dtype=torch.float64, device=loss_M.device)
    flags[rank * loss_M.shape[0]:(rank + 1) * loss_M.shape[0]] = (~torch.isfinite(loss_M)).double()
    counts = torch.tensor([tokens, anchors, float(stop)], dtype=torch.float64).to(loss_M.device)
    values = torch.cat([loss_M.sum()[None], counts, flags])
    if world > 1:
        dist.all_reduce(values)
    loss_sum, tokens_sum, anchors_sum, stop_sum, *flag_sums = values.tolist()
    return loss_sum, int(tokens_sum), int(anchors_sum), flag_sums, stop_sum > 0


def _check_losses(s: Session, order: list[int], losses: list[torch.Tensor], tokens: int, anchors: int,
                  stop_requested: bool) -> tuple[float, int, int, bool]:
    """The step's scalars summed over ranks (`_step_scalars`): (loss sum, tokens, anchors, whether the ranks stop).
    Before the update: a non-finite loss on any rank stops every rank here, before engine.step() applies it."""
    state, p = s.state, s.placement
    loss_sum, tokens, anchors, bad_loss_flags, stop_agreed = _step_scalars(losses, tokens, anchors, p.rank,
                                                                           p.world_size, stop_requested)
    check_losses_finite(step=state.step + 1, epoch=state.epoch, bad_loss_flags=bad_loss_flags, data=s.data,
                        order=order, batch_in_epoch=state.batch_in_epoch, grad_accum=s.plan.grad_accum_steps,
                        world_size=p.world_size)
    return loss_sum, tokens, anchors, stop_agreed


def _check_gradients(s: Session, order: list[int]) -> None:
    """After the update: a non-finite gradient norm stops the run before the step is logged or saved."""
    state = s.state
    check_grad_norm_finite(step=state.step, epoch=state.epoch, grad_norm=s.engine.get_global_grad_norm(), data=s.data,
                           order=order, batch_in_epoch=state.batch_in_epoch - 1, grad_accum=s.plan.grad_accum_steps,
                           world_size=s.placement.world_size)


def _finish(s: Session, logger: MetricLogger, marks: RunMarks, stop: StopRequest) -> None:
    """The end of a run that reached its last step: that step validated and saved, then the end-of-training hooks."""
    if marks.validated_step != s.state.step:
        marks.validation = validate(s, logger)
    if marks.checkpoint is None or not marks.checkpoint.name.endswith(f"{s.state.step:08d}"):
        marks.checkpoint = s.checkpointer.save(s.engine, s.state, s.average)
    if _any_rank(stop.requested, s):  # a SIGTERM during the final validation or save
        raise _terminated(s, logger, marks.checkpoint, "; the end-of-training hooks (e.g. calibration) did not run")
    stop.release()  # the hooks are no safe point to wait for: from here SIGTERM ends the process at once
    with averaged(s):  # the checkpoint's drafter/ holds the average: calibrate that
        for hook in s.on_train_end:  # e.g. the confidence head's calibration (deepspec.training.hooks)
            hook(s, marks.checkpoint)


def _any_rank(flag: bool, s: Session) -> bool:
    """`flag` of any rank (one small all-reduce): a decision every rank takes together."""
    if s.placement.world_size == 1:
        return flag
    value = torch.tensor([float(flag)], device=s.placement.device)
    dist.all_reduce(value)
    return value.item() > 0


def _terminated(s: Session, logger: MetricLogger, saved: Path, note: str) -> Terminated:
    """The one-line report of a run stopped by SIGTERM after its checkpoint `saved` was written."""
    logger.close()
    message = (f"stopped by SIGTERM after step {s.state.step} of {s.total_steps}: saved the checkpoint {saved}{note}; "
               "rerun the same command to resume from it")
    log.warning(message)
    return Terminated(message)


def averaged(s: Session):
    """The drafter with the average of its weights inside the block (trainer.ema_decay), else as it is."""
    return s.average.swapped_in() if s.average is not None else nullcontext()


def validate(s: Session, logger: MetricLogger) -> dict:
    p = s.placement
    with averaged(s):
        metrics = run_validation(s.engine, s.data, s.num_positions, p.rank, p.world_size, p.device, p.dtype)
        if s.decode_prompts and p.rank == 0:  # decoded tau next to the simulated one (validation.py)
            t = s.cfg.trainer
            metrics.update(run_decode_validation(s.drafter, s.target.model, s.decode_prompts,
                                                 t.decode_eval_temperatures, t.decode_eval_max_new_tokens,
                                                 s.eos_token_ids, t.seed, simulated=metrics))
    if metrics:  # the training cost so far, for learning curves (deepspec.benchmarks.learning)
        metrics.update(tokens_seen=s.state.tokens_seen, train_cpu_s=s.state.train_cpu_s)
        logger.log(metrics, s.state.step, "validation")
    return metrics


def open_logger(s: Session) -> MetricLogger:
    """The run's metric sinks (`logger`), with the resolved config saved beside them (config.yaml)."""
    from omegaconf import OmegaConf

    save_resolved_config(s.cfg, s.out_dir, s.placement.rank)
    return MetricLogger(s.cfg.logger, s.out_dir, s.placement.rank,
                        run_config=OmegaConf.to_container(OmegaConf.structured(s.cfg)), run_name=s.cfg.run_name,
                        resume=s.resumed_from is not None, first_step=s.state.step)

"""The training loop: batch -> loss -> engine.backward -> engine.step -> log -> validate -> checkpoint.

`run(cfg)` builds a `Session` (deepspec.training.session) and calls `train(session)`. Everything that is
not the loop itself (DeepSpeed set-up, checkpoints, data order, metrics, log sinks) lives in its own module.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from deepspec.drafters.spec import capabilities_of
from deepspec.targets.sharding import is_partitioned
from deepspec.training.checkpoint import DRAFTER_DIR
from deepspec.training.guards import check_grad_norm_finite, check_losses_finite
from deepspec.training.log import MetricLogger, ProgressBar, save_resolved_config
from deepspec.training.session import Session, build_session
from deepspec.training.validation import run_decode_validation, run_validation
from deepspec.utils.phases import PhaseTimer, phase
from deepspec.utils.termination import StopRequest, Terminated, stop_on_sigterm

log = logging.getLogger(__name__)


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


def train(s: Session, stop: StopRequest | None = None) -> dict:
    """`stop`: set by a SIGTERM (`run` installs the handler): every rank stops after the same step, saved."""
    cfg, t, data, engine, state, p = s.cfg, s.cfg.trainer, s.data, s.engine, s.state, s.placement
    stop = stop or StopRequest()
    grad_accum = s.plan.grad_accum_steps
    save_resolved_config(cfg, s.out_dir, s.placement.rank)
    logger = MetricLogger(cfg.logger, s.out_dir, s.placement.rank, run_config=_config_dict(cfg), run_name=cfg.run_name,
                          resume=s.resumed_from is not None, first_step=state.step)
    bar = ProgressBar(s.total_steps, state.step, enabled=t.progress_bar and s.placement.rank == 0)
    engine.train()
    if s.placement.device.type == "cuda":  # peak_mem_mb below is this run's (the target's weights included)
        torch.cuda.reset_peak_memory_stats(s.placement.device)
    order, order_epoch = None, None
    last_saved, last_validated, last_val = None, None, {}
    stopped = False
    loss_checkpointed = None  # loss.checkpoint=auto decides per batch size: logged when the decision changes

    def checkpoint() -> Path:
        return s.checkpointer.save(engine, state, s.average)

    if t.val_at_start and state.step == 0 and s.total_steps > 0:
        last_val = validate(s, logger)

    timer = PhaseTimer() if t.phase_times else None  # trainer.phase_times: where each step's CPU time goes
    terminated = False  # a SIGTERM: the ranks agreed to stop after this step
    with timer or nullcontext():
        while state.step < s.total_steps:
            if state.batch_in_epoch >= data.steps_per_epoch:  # epoch boundary: new order, new anchors
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if order_epoch != state.epoch:
                with phase("data"):
                    order, order_epoch = data.epoch_order(state.epoch), state.epoch
            step_start, step_cpu_start = time.perf_counter(), time.process_time()
            step_losses, tokens, anchors = [], 0, 0
            # Gradient accumulation: each micro step's backward adds into the same gradient buffers (DeepSpeed
            # scales each loss by 1/grad_accum); engine.step() only updates weights at the accumulation boundary,
            # where the gradients are reduced across ranks. Every rank runs the same number of micro steps.
            for micro_step in range(grad_accum):
                with phase("data"):
                    ids = data.micro_batch_ids(order, state.batch_in_epoch, micro_step, p.rank, p.world_size)
                    batch = data.collate(ids, state.epoch)
                    counts = data.counts(batch)  # from the batcher's host-side stats: no device read
                with phase("target"):
                    batch = batch.to(s.placement.device, s.placement.dtype)
                with phase("loss"):
                    loss, result = engine(batch)  # drafter forward + objective (session.TrainingModule)
                decision = result.terms.checkpoint
                if decision is not None and decision.checkpoint != loss_checkpointed and s.placement.rank == 0:
                    loss_checkpointed = decision.checkpoint
                    log.info("step %d: %s", state.step + 1, decision.note)
                step_losses.append(loss.detach())
                tokens, anchors = tokens + counts.tokens, anchors + counts.anchors
                with phase("backward"):
                    engine.backward(loss)  # a non-finite loss still runs: every rank stays in the collectives
                if micro_step == grad_accum - 1:
                    with phase("guards"):
                        # The step's scalars, read once and summed over ranks before the update: a non-finite loss on
                        # any rank stops every rank here, before engine.step() applies it.
                        loss_total, tokens, anchors, bad_loss_flags, stop_agreed = _step_scalars(
                            step_losses, tokens, anchors, s.placement.rank, s.placement.world_size, stop.requested)
                        check_losses_finite(step=state.step + 1, epoch=state.epoch, bad_loss_flags=bad_loss_flags,
                                            data=data, order=order, batch_in_epoch=state.batch_in_epoch,
                                            grad_accum=grad_accum, world_size=s.placement.world_size)
                with phase("optimizer"):
                    engine.step()
            if s.average is not None:
                with phase("optimizer"):
                    s.average.update()
            state.step += 1
            state.batch_in_epoch += 1
            with phase("guards"):
                check_grad_norm_finite(step=state.step, epoch=state.epoch, grad_norm=engine.get_global_grad_norm(),
                                       data=data, order=order, batch_in_epoch=state.batch_in_epoch - 1,
                                       grad_accum=grad_accum, world_size=s.placement.world_size)
            step_seconds = time.perf_counter() - step_start
            step_cpu_s = time.process_time() - step_cpu_start  # this process's CPU time: fair on a shared machine
            state.train_cpu_s += step_cpu_s
            state.samples_seen += t.global_batch_size
            state.tokens_seen += int(tokens)
            train_loss = loss_total / (grad_accum * s.placement.world_size)
            log_now = state.step % t.log_every == 0 or state.step == s.total_steps
            # The phases since the previous record: this record's logging is in the next one's.
            phases = timer.take() if timer is not None and log_now else {}
            with phase("logging"):
                bar.update(train_loss, tokens / step_seconds, anchors / step_seconds)
                if log_now:
                    memory = ({"peak_mem_mb": torch.cuda.max_memory_allocated(s.placement.device) / 2**20}
                              if s.placement.device.type == "cuda" else {})
                    logger.log({"loss": train_loss, "lr": engine.get_lr()[0], "epoch": state.epoch,
                                "tokens_per_s": tokens / step_seconds, "anchors_per_s": anchors / step_seconds,
                                "step_ms": 1000 * step_seconds, "step_cpu_s": step_cpu_s,
                                "tokens_seen": state.tokens_seen, "train_cpu_s": state.train_cpu_s, **memory,
                                **phases, **{f"loss_{k}": v for k, v in result.loss.parts.items()}},
                               state.step, "train")
            if stop_agreed:  # a SIGTERM reached some rank: all stop after this same step, saved below
                terminated = True
                break
            if state.step % t.val_every == 0:
                with phase("validation"):
                    last_val = validate(s, logger)
                last_validated = state.step
            if s.checkpointer.due(state.step):
                last_saved = checkpoint()
            if cfg.faults.should_stop(state.step):
                # Fault injection: leave exactly as a kill would, with only the periodic checkpoints on disk.
                log.warning("faults.stop_after=%d reached: stopping as if killed", cfg.faults.stop_after)
                stopped = True
                break
    bar.close()
    if terminated:
        raise _terminated(s, logger, checkpoint(), "")
    if not stopped:
        if last_validated != state.step:
            last_val = validate(s, logger)
        if last_saved is None or not last_saved.name.endswith(f"{state.step:08d}"):
            last_saved = checkpoint()
        if _any_rank(stop.requested, s):  # a SIGTERM during the final validation or save
            raise _terminated(s, logger, last_saved, "; the end-of-training hooks (e.g. calibration) did not run")
        stop.release()  # the hooks are no safe point to wait for: from here SIGTERM ends the process at once
        with averaged(s):  # the checkpoint's drafter/ holds the average: calibrate that
            for callback in s.on_train_end:  # e.g. calibration of the confidence head (lead wires it)
                callback(s, last_saved)
    logger.close()
    return {"step": state.step, "stopped": stopped, "checkpoint": str(last_saved) if last_saved else None,
            "validation": last_val, "out_dir": str(s.out_dir)}


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


def calibrate_after_training_hook(session: Session, checkpoint: Path | None):
    """`on_train_end` hook: STS of the confidence head on the training cache's validation split (the run's
    `calibration:` section: rollouts with the training target by default), results under
    `<out_dir>/calibration/`, temperatures into the last checkpoint's
    saved drafter. Rank 0 only; under ZeRO-3 the drafter's weights would have to be gathered first: not
    supported, skipped with a warning (run `deepspec calibrate` on the checkpoint)."""
    from deepspec.calibration.run import calibrate_after_training

    if session.placement.rank != 0:
        return None
    if is_partitioned(session.target):
        log.warning("calibration after training skipped with data.target_sharding=%s (rank 0 would run a target whose "
                    "weights every rank holds a part of alone): run `deepspec calibrate` on the checkpoint",
                    session.cfg.data.target_sharding)
        return None
    if session.cfg.deepspeed.stage == 3:
        log.warning("calibration after training skipped under ZeRO-3: run `deepspec calibrate` on the checkpoint")
        return None
    drafter_dir = Path(checkpoint) / DRAFTER_DIR if checkpoint is not None else None
    dirs = [drafter_dir] if drafter_dir is not None and drafter_dir.is_dir() else []
    return calibrate_after_training(session.out_dir, session.drafter, session.data.reader, session.cfg.calibration,
                                    drafter_dirs=dirs, target=session.target)


def _calibrate_confidence(session: Session, checkpoint) -> None:
    """The hook with a failure (e.g. a validation split too small for the configured minimum) reported, not
    fatal: `deepspec calibrate` can be rerun."""
    try:
        calibrate_after_training_hook(session, checkpoint)
    except ValueError as err:
        log.warning("calibration after training skipped: %s (run `deepspec calibrate --drafter %s/drafter "
                    "--cache ...` with a larger validation split or a lower --min-samples)", err, checkpoint)


def averaged(s: Session):
    """The drafter with the average of its weights inside the block (trainer.ema_decay), else as it is."""
    return s.average.swapped_in() if s.average is not None else nullcontext()


def validate(s: Session, logger: MetricLogger) -> dict:
    with averaged(s):
        p = s.placement
        metrics = run_validation(s.engine, s.data, s.num_positions, p.rank, p.world_size, p.device, p.dtype)
        if s.decode_prompts and s.placement.rank == 0:  # decoded tau next to the simulated one (validation.py)
            t = s.cfg.trainer
            metrics.update(run_decode_validation(s.drafter, s.target.model, s.decode_prompts,
                                                 t.decode_eval_temperatures, t.decode_eval_max_new_tokens,
                                                 s.eos_token_ids, t.seed, simulated=metrics))
    if metrics:  # the training cost so far, for learning curves (deepspec.benchmarks.learning)
        metrics.update(tokens_seen=s.state.tokens_seen, train_cpu_s=s.state.train_cpu_s)
        logger.log(metrics, s.state.step, "validation")
    return metrics


def _config_dict(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def run(cfg, out_dir: str | None = None, on_train_end: list[Callable] | None = None,
        on_start: list[Callable[[Session], None]] | None = None) -> dict:
    """Train from a composed config (DictConfig / dict / TrainConfig). Returns a summary dict. `on_start`: called
    with the session once it is built, holding the output folder's lock (e.g. to record the run there)."""
    session = build_session(cfg, out_dir=out_dir, on_train_end=on_train_end)
    if session.cfg.calibration.enabled and capabilities_of(session.drafter).confidence_head:
        session.on_train_end.append(_calibrate_confidence)
    try:
        for callback in on_start or []:
            callback(session)
        with stop_on_sigterm("saving a checkpoint after the current optimizer step, then exiting") as stop:
            return train(session, stop)
    finally:
        session.engine.destroy()
        session.lock.close()  # releases this rank's lock on the output folder

"""TRL's `callbacks=` (docs/coming-from-trl.md), called as transformers' CallbackHandler calls them, in the order
given, each one's returned control (if any) replacing the one before. The loop (Trainer.train) acts on the
`TrainerControl` they leave."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerControl:
    """transformers' TrainerControl, its fields and their meaning (importing its own class costs seconds).
    `should_epoch_stop` is accepted and not read: the loop is not one of epochs."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class Callbacks:
    """The callbacks of one Trainer: `args` (the Config) and `state` (trainer.state) are the Trainer's own, and
    every hook gets the keyword arguments transformers passes (the dataloaders None: there are none here)."""

    def __init__(self, callbacks, args, state, model, processing_class, optimizer, lr_scheduler):
        # transformers' add_callback takes a class too, and makes one.
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks or ()]
        self.args, self.state, self.control = args, state, TrainerControl()
        # `tokenizer` too, as transformers passed it before processing_class: callbacks written then read it.
        self.objects = dict(model=model, processing_class=processing_class, tokenizer=processing_class,
                            optimizer=optimizer, lr_scheduler=lr_scheduler, train_dataloader=None,
                            eval_dataloader=None)

    def call(self, event: str, **kwargs) -> TrainerControl:
        """Every callback's `event` method (those without one are passed over); returns the control left."""
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:
                result = hook(self.args, self.state, self.control, **self.objects, **kwargs)
                self.control = self.control if result is None else result
        return self.control

    # transformers' CallbackHandler resets these flags before calling the hooks of the same names.
    def on_train_begin(self) -> TrainerControl:
        self.control.should_training_stop = False
        return self.call("on_train_begin")

    def on_step_begin(self) -> TrainerControl:
        self.control.should_log = self.control.should_evaluate = self.control.should_save = False
        return self.call("on_step_begin")

    def on_step_end(self, log: bool, evaluate: bool, save: bool) -> TrainerControl:
        """The run's own cadence (settings/plan.Cadence) sets its flags first, as transformers'
        DefaultFlowCallback does ahead of the others; the callbacks may then set or clear any of them."""
        control = self.control
        control.should_log, control.should_evaluate = control.should_log or log, control.should_evaluate or evaluate
        control.should_save = control.should_save or save
        return self.call("on_step_end")

    def on_log(self, logs: dict) -> TrainerControl:
        self.control.should_log = False
        return self.call("on_log", logs=logs)

    def on_evaluate(self, metrics: dict) -> TrainerControl:
        self.control.should_evaluate = False
        return self.call("on_evaluate", metrics=metrics)

    def on_save(self) -> TrainerControl:
        self.control.should_save = False
        return self.call("on_save")

    def on_train_end(self) -> TrainerControl:
        return self.call("on_train_end")


class ReferenceSync:
    """TRL's SyncRefModelCallback: every `ref_model_sync_steps` optimizer steps, once the step is done, the
    policy mixed into the reference copy (policy/forwards.Policy.mix_into_reference)."""

    def __init__(self, policy):
        self.policy = policy

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.policy.mix_into_reference(args.ref_model_mixup_alpha)

"""Learners: FSDP ranks training the LoRA policy; losses and advantages as pure functions."""

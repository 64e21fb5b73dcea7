"""What every layer of a run leans on and nothing of GRPO: progress bars and token counters, the torchrun
process group and its collectives, the CPU allocator's settings, stop signals, children that die with their
parent, and the lines libraries log that name nothing to fix, dropped."""

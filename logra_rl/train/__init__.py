"""Training: the FSDP2 TrainWorker, its batches, and the LoGRA / dense update rules."""

"""`python -m mrl train ...`: what the launchers run (`torchrun --nproc_per_node=N -m mrl train ...`,
`deepspeed --num_gpus N --module mrl train ...`)."""

from mrl.cli import main

if __name__ == "__main__":
    main()

/* Empty stand-in (dev/cuda_emu): tensor/cuda/check.h includes it. */
#pragma once

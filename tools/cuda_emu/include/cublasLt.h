/* Empty stand-in (tools/cuda_emu): tensor/cuda/check.h includes it. */
#pragma once

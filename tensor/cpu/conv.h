/* CPU kernels of 2-D convolution (im2col + OpenBLAS GEMM, one image and
 * channel group at a time, several images per GEMM; a direct loop when each group has one input
 * channel, as in a depthwise convolution). All tensors are contiguous raw
 * buffers of one float dtype.
 *
 * Letters: N batch, C input channels, O output channels, G groups (CG =
 * C/G, OG = O/G per group), H/W input size, KH/KW kernel size, OH/OW
 * output size; K = CG*KH*KW, P = OH*OW. */
#ifndef NABLA_TENSOR_CPU_CONV_H
#define NABLA_TENSOR_CPU_CONV_H

#include <stddef.h>
#include <stdint.h>

#include "tensor/internal.h" /* nb__conv2d_geom */


/* Elements of the column buffer (one group, the images of one GEMM: their
 * columns and their product, (K + OG) * P per image), or 0 for a 1x1
 * kernel with unit stride and no padding (the image is its own columns) or
 * for one input channel per group (direct loop). */
int64_t nb__conv2d_cols_numel(const nb__conv2d_geom *g);
/* The column buffer's bytes for dtype dt (bf16 columns are f32). */
size_t nb__conv2d_cols_bytes(nb_dtype dt, const nb__conv2d_geom *g);

/* out (N, O, OH, OW) = conv(x (N, C, H, W), w (O, CG, KH, KW)) + b (O) or
 * no bias when b is NULL; dt f32, f64 or bf16 (computed in f32, rounded
 * once). cols: scratch of nb__conv2d_cols_bytes. */
void nb__cpu_conv2d_forward_cols(nb_dtype dt, const nb__conv2d_geom *g, void *out, const void *x,
                                 const void *w, const void *b, void *cols);

/* Gradients from gout (N, O, OH, OW); each of dx (N, C, H, W), dw
 * (O, CG, KH, KW), db (O) is written (not accumulated) unless NULL. x is
 * needed for dw, w for dx. */
void nb__cpu_conv2d_backward_cols(nb_dtype dt, const nb__conv2d_geom *g, void *dx, void *dw,
                                  void *db, const void *gout, const void *x, const void *w,
                                  void *cols);

#endif

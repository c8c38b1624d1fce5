//! A multilayer perceptron with a hand-written backward pass: `Linear - ReLU - ... - Linear`,
//! softmax cross-entropy, parameters and gradients as one flat `Vec<f32>`.
//!
//! Layer `l` maps `dims[l]` inputs to `dims[l+1]` outputs; its weight is stored input-major
//! (`w[i * out + j]`), followed by its bias. All products are written in i-k-j order with a
//! contiguous innermost loop over output features, which LLVM vectorises; zero inputs (most
//! background pixels, every inactive ReLU) are skipped.
//!
//! # Gradient readiness
//!
//! Backward visits the layers last to first. For each layer it finishes the bias gradient, then
//! the weight gradient in blocks of rows (last block first), and hands each finished piece to
//! the caller's `ready` callback before computing the gradient of the layer's input. The pieces
//! are the "parameters" registered with the reducer ([`Mlp::grad_ranges`], in forward order).
//! Reporting the weight in row blocks matters for this model: the first layer holds most of the
//! parameters and its gradient is the last one backward produces, so as one piece it would be
//! a single bucket that can only start when backward is over. In blocks, the first blocks'
//! all-reduces run while the remaining blocks are computed.

use std::ops::Range;

/// One linear layer's place in the flat parameter vector.
#[derive(Clone, Debug)]
struct Layer {
    inp: usize,
    out: usize,
    w: usize,
    b: usize,
    /// Row blocks of the weight: (reducer parameter index, rows).
    blocks: Vec<(usize, Range<usize>)>,
    /// Reducer parameter index of the bias.
    bias_param: usize,
}

/// The model's shape and parameter layout (the parameters themselves live in a `Vec<f32>`).
#[derive(Clone, Debug)]
pub struct Mlp {
    dims: Vec<usize>,
    layers: Vec<Layer>,
    ranges: Vec<Range<usize>>,
    len: usize,
}

/// Scratch buffers for one batch, reused across calls.
#[derive(Debug, Default)]
pub struct Workspace {
    /// Input of each layer (post-ReLU output of the previous one), `batch x dims[l]`.
    acts: Vec<Vec<f32>>,
    logits: Vec<f32>,
    delta: Vec<f32>,
    delta_in: Vec<f32>,
}

/// Dot product with eight independent partial sums, so that it vectorises without reordering
/// permission (floating-point addition is not associative).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a * x`, element-wise.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

impl Mlp {
    /// A perceptron with layer widths `dims` (input, hidden..., classes), whose weight
    /// gradients are reported in row blocks of at most about `block_elems` elements.
    pub fn new(dims: &[usize], block_elems: usize) -> Self {
        assert!(
            dims.len() >= 2 && dims.iter().all(|&d| d > 0),
            "bad layer widths {dims:?}"
        );
        let mut layers = Vec::new();
        let mut ranges = Vec::new();
        let mut off = 0;
        for win in dims.windows(2) {
            let (inp, out) = (win[0], win[1]);
            let rows_per_block = (block_elems / out).max(1);
            let w = off;
            let mut blocks = Vec::new();
            let mut r = 0;
            while r < inp {
                let end = (r + rows_per_block).min(inp);
                blocks.push((ranges.len(), r..end));
                ranges.push(w + r * out..w + end * out);
                r = end;
            }
            let b = w + inp * out;
            let bias_param = ranges.len();
            ranges.push(b..b + out);
            off = b + out;
            layers.push(Layer {
                inp,
                out,
                w,
                b,
                blocks,
                bias_param,
            });
        }
        Mlp {
            dims: dims.to_vec(),
            layers,
            ranges,
            len: off,
        }
    }

    /// Layer widths.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Number of parameters (elements of the flat vector).
    pub fn len(&self) -> usize {
        self.len
    }

    /// The gradient pieces reported by backward, as ranges of the flat vector, in forward
    /// order (weight row blocks then bias, layer by layer).
    pub fn grad_ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Parameters initialised from `seed`: weights uniform with He's variance `2 / fan_in`
    /// (suited to ReLU), biases zero.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut p = vec![0.0; self.len];
        let mut state = seed ^ 0x5851_f42d_4c95_7f2d;
        for l in &self.layers {
            let bound = (6.0 / l.inp as f32).sqrt();
            for w in &mut p[l.w..l.b] {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                *w = (2.0 * u - 1.0) * bound;
            }
        }
        p
    }

    /// Forward over a batch `x` (`n x dims[0]`); leaves every layer's input and the logits in
    /// `ws`.
    fn forward(&self, p: &[f32], x: &[f32], ws: &mut Workspace) -> usize {
        let n = x.len() / self.dims[0];
        ws.acts.resize_with(self.layers.len(), Vec::new);
        ws.acts[0].clear();
        ws.acts[0].extend_from_slice(x);
        for (li, l) in self.layers.iter().enumerate() {
            let last = li + 1 == self.layers.len();
            let mut z = if last {
                std::mem::take(&mut ws.logits)
            } else {
                std::mem::take(&mut ws.acts[li + 1])
            };
            z.clear();
            let w = &p[l.w..l.b];
            let bias = &p[l.b..l.b + l.out];
            let a = &ws.acts[li];
            for s in 0..n {
                z.extend_from_slice(bias);
                let zs = &mut z[s * l.out..(s + 1) * l.out];
                for (i, &ai) in a[s * l.inp..(s + 1) * l.inp].iter().enumerate() {
                    if ai != 0.0 {
                        axpy(zs, ai, &w[i * l.out..(i + 1) * l.out]);
                    }
                }
                if !last {
                    for v in zs.iter_mut() {
                        *v = v.max(0.0);
                    }
                }
            }
            if last {
                ws.logits = z;
            } else {
                ws.acts[li + 1] = z;
            }
        }
        n
    }

    /// Forward and backward over the batch `x` (`n x dims[0]`, labels `y`); returns the mean
    /// cross-entropy loss. The gradient of the mean loss is written into `grad` (same layout as
    /// `p`), and every piece of it is handed to `ready(param, gradient)` as soon as it is
    /// final, last layer first (see the [module documentation](self)).
    pub fn forward_backward(
        &self,
        p: &[f32],
        x: &[f32],
        y: &[u8],
        ws: &mut Workspace,
        grad: &mut [f32],
        mut ready: impl FnMut(usize, &[f32]),
    ) -> f32 {
        let n = self.forward(p, x, ws);
        let classes = *self.dims.last().expect("at least two widths");
        let scale = 1.0 / n as f32;
        let mut loss = 0.0f64;
        ws.delta.clear();
        for (z, &label) in ws.logits.chunks_exact(classes).zip(&y[..n]) {
            let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = z.iter().map(|v| (v - m).exp()).sum();
            let label = usize::from(label);
            loss += f64::from(sum.ln() + m - z[label]);
            for (j, v) in z.iter().enumerate() {
                let softmax = (v - m).exp() / sum;
                ws.delta
                    .push((softmax - if j == label { 1.0 } else { 0.0 }) * scale);
            }
        }
        for (li, l) in self.layers.iter().enumerate().rev() {
            let a = &ws.acts[li];
            let dz = &ws.delta;
            // Bias: the column sums of dz.
            let gb = &mut grad[l.b..l.b + l.out];
            gb.fill(0.0);
            for s in 0..n {
                for (g, d) in gb.iter_mut().zip(&dz[s * l.out..(s + 1) * l.out]) {
                    *g += d;
                }
            }
            ready(l.bias_param, gb);
            // Weight, in row blocks, last block first: dW[i, :] += a[s, i] * dz[s, :].
            for (param, rows) in l.blocks.iter().rev() {
                let gw = &mut grad[l.w + rows.start * l.out..l.w + rows.end * l.out];
                gw.fill(0.0);
                for s in 0..n {
                    let dzs = &dz[s * l.out..(s + 1) * l.out];
                    let a_s = &a[s * l.inp..(s + 1) * l.inp];
                    for (r, i) in rows.clone().enumerate() {
                        if a_s[i] != 0.0 {
                            axpy(&mut gw[r * l.out..(r + 1) * l.out], a_s[i], dzs);
                        }
                    }
                }
                ready(*param, gw);
            }
            // Gradient of the layer's input, through the previous layer's ReLU:
            // da[s, i] = (a[s, i] > 0) * dot(dz[s, :], w[i, :]).
            if li > 0 {
                let w = &p[l.w..l.b];
                ws.delta_in.clear();
                for s in 0..n {
                    let dzs = &dz[s * l.out..(s + 1) * l.out];
                    for i in 0..l.inp {
                        let g = if a[s * l.inp + i] > 0.0 {
                            dot(dzs, &w[i * l.out..(i + 1) * l.out])
                        } else {
                            0.0
                        };
                        ws.delta_in.push(g);
                    }
                }
                std::mem::swap(&mut ws.delta, &mut ws.delta_in);
            }
        }
        (loss / n as f64) as f32
    }

    /// Classifies the batch `x`; returns the number of correct predictions and the summed
    /// cross-entropy loss.
    pub fn evaluate(&self, p: &[f32], x: &[f32], y: &[u8], ws: &mut Workspace) -> (usize, f64) {
        let n = self.forward(p, x, ws);
        let classes = *self.dims.last().expect("at least two widths");
        let mut correct = 0;
        let mut loss = 0.0;
        for (z, &label) in ws.logits.chunks_exact(classes).zip(&y[..n]) {
            let mut best = 0;
            for (j, &v) in z.iter().enumerate() {
                if v > z[best] {
                    best = j;
                }
            }
            let m = z[best];
            let label = usize::from(label);
            correct += usize::from(best == label);
            let sum: f32 = z.iter().map(|v| (v - m).exp()).sum();
            loss += f64::from(sum.ln() + m - z[label]);
        }
        (correct, loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_blocks() {
        let m = Mlp::new(&[5, 4, 3], 8);
        assert_eq!(m.len(), 5 * 4 + 4 + 4 * 3 + 3);
        // Layer 0: 5 rows of 4 in blocks of 2 rows, then its bias; layer 1: 4 rows of 3 in
        // blocks of 2 rows, then its bias.
        assert_eq!(
            m.grad_ranges(),
            &[0..8, 8..16, 16..20, 20..24, 24..30, 30..36, 36..39]
        );
        let covered: usize = m.grad_ranges().iter().map(|r| r.len()).sum();
        assert_eq!(covered, m.len());
    }

    /// The analytic gradient matches central differences of the loss.
    #[test]
    fn backward_matches_finite_differences() {
        let m = Mlp::new(&[6, 5, 4, 3], 7);
        let mut p = m.init(3);
        for (i, v) in p.iter_mut().enumerate() {
            *v += 0.01 * (i % 7) as f32; // non-zero biases too
        }
        let x: Vec<f32> = (0..4 * 6)
            .map(|i| ((i * 37 % 11) as f32 - 3.0) / 5.0)
            .collect();
        let y = [0u8, 2, 1, 2];
        let mut ws = Workspace::default();
        let mut g = vec![0.0; m.len()];
        let mut order = Vec::new();
        let mut seen = vec![0.0f32; m.len()];
        let ranges = m.grad_ranges().to_vec();
        m.forward_backward(&p, &x, &y, &mut ws, &mut g, |i, gi| {
            order.push(i);
            seen[ranges[i].clone()].copy_from_slice(gi);
        });
        // Every piece reported once, last layer first, each piece final when reported.
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..ranges.len()).collect::<Vec<_>>());
        assert_eq!(order[0], ranges.len() - 1);
        assert_eq!(seen, g);
        let loss = |p: &[f32]| {
            let mut ws = Workspace::default();
            let mut g = vec![0.0; m.len()];
            f64::from(m.forward_backward(p, &x, &y, &mut ws, &mut g, |_, _| {}))
        };
        for i in 0..m.len() {
            let h = 1e-2;
            let (mut a, mut b) = (p.clone(), p.clone());
            a[i] += h;
            b[i] -= h;
            let num = (loss(&a) - loss(&b)) / (2.0 * f64::from(h));
            assert!(
                (num - f64::from(g[i])).abs() < 2e-3,
                "parameter {i}: analytic {} numeric {num}",
                g[i]
            );
        }
    }
}

//! Fashion-MNIST from the Debian package `dataset-fashion-mnist`, and the sharding of global
//! batches over ranks.
//!
//! The files are the original idx files, gzip-compressed: `train-images-idx3-ubyte.gz` (60,000
//! images of 28 x 28 bytes), `train-labels-idx1-ubyte.gz`, and the 10,000-image test set
//! `t10k-*`. An idx file is a big-endian header, the magic number `0x0000_08 NN` (`08` = unsigned
//! bytes, `NN` = number of dimensions), one `u32` per dimension, then the bytes.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};

/// Where `dataset-fashion-mnist` installs the files.
pub const DEFAULT_DIR: &str = "/usr/share/datasets/fashion-mnist";
/// Pixels per image.
pub const PIXELS: usize = 28 * 28;
/// Classes.
pub const CLASSES: usize = 10;

/// One split of the dataset: images (one byte per pixel, row-major) and labels.
#[derive(Debug)]
pub struct Split {
    /// `len() * PIXELS` bytes.
    pub images: Vec<u8>,
    /// One class in `0..CLASSES` per image.
    pub labels: Vec<u8>,
}

impl Split {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Writes image `i` as `f32` in [0, 1] into `out` (`PIXELS` elements).
    pub fn pixels_into(&self, i: usize, out: &mut [f32]) {
        for (o, &p) in out
            .iter_mut()
            .zip(&self.images[i * PIXELS..(i + 1) * PIXELS])
        {
            *o = f32::from(p) * (1.0 / 255.0);
        }
    }
}

/// The training and test splits.
#[derive(Debug)]
pub struct FashionMnist {
    /// 60,000 training images.
    pub train: Split,
    /// 10,000 test images.
    pub test: Split,
}

/// The four files of the dataset.
pub const FILES: [&str; 4] = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
];

/// The path of `name` in `dir`, or an error that says how to install the dataset.
fn file(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let p = dir.join(name);
    if !p.is_file() {
        bail!(
            "Fashion-MNIST not found: {} is missing; install it with `apt-get install dataset-fashion-mnist` (or pass --data DIR)",
            p.display()
        );
    }
    Ok(p)
}

/// Checks that every file of the dataset is in `dir` (without reading them).
pub fn check_files(dir: &Path) -> anyhow::Result<()> {
    FILES.iter().try_for_each(|f| file(dir, f).map(drop))
}

/// Reads both splits from `dir`; a missing file yields an error that says how to install it.
pub fn load(dir: &Path) -> anyhow::Result<FashionMnist> {
    let file = |name: &str| file(dir, name);
    let split = |prefix: &str| -> anyhow::Result<Split> {
        let images = read_idx(&file(&format!("{prefix}-images-idx3-ubyte.gz"))?, &[28, 28])?;
        let labels = read_idx(&file(&format!("{prefix}-labels-idx1-ubyte.gz"))?, &[])?;
        ensure!(
            images.1 == labels.1,
            "{prefix}: {} images but {} labels",
            images.1,
            labels.1
        );
        if let Some(bad) = labels.0.iter().find(|&&l| usize::from(l) >= CLASSES) {
            bail!("{prefix}: label {bad} is not a class of Fashion-MNIST");
        }
        Ok(Split {
            images: images.0,
            labels: labels.0,
        })
    };
    Ok(FashionMnist {
        train: split("train")?,
        test: split("t10k")?,
    })
}

/// Reads a gzip-compressed idx file of unsigned bytes whose dimensions after the first are
/// `inner`; returns the data and the first dimension.
pub fn read_idx(path: &Path, inner: &[u32]) -> anyhow::Result<(Vec<u8>, usize)> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::io::BufReader::new(f))
        .read_to_end(&mut raw)
        .with_context(|| format!("cannot decompress {}", path.display()))?;
    parse_idx(&raw, inner).with_context(|| format!("{} is not a valid idx file", path.display()))
}

/// Parses an uncompressed idx file of unsigned bytes (see [`read_idx`]).
pub fn parse_idx(raw: &[u8], inner: &[u32]) -> anyhow::Result<(Vec<u8>, usize)> {
    let ndim = inner.len() + 1;
    let header = 4 + 4 * ndim;
    ensure!(
        raw.len() >= header,
        "{} bytes is shorter than its header",
        raw.len()
    );
    let word =
        |i: usize| u32::from_be_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]]);
    let magic = word(0);
    ensure!(
        magic == 0x0800 | ndim as u32,
        "magic number {magic:#010x}, expected {:#010x} (unsigned bytes, {ndim} dimensions)",
        0x0800 | ndim as u32
    );
    let dims: Vec<u32> = (1..=ndim).map(word).collect();
    ensure!(
        dims[1..] == *inner,
        "dimensions {dims:?}, expected [n, {inner:?}]"
    );
    let n = dims[0] as usize;
    let each: usize = inner.iter().map(|&d| d as usize).product();
    ensure!(
        raw.len() == header + n * each,
        "{} bytes of data, expected {} for {dims:?}",
        raw.len() - header,
        n * each
    );
    Ok((raw[header..].to_vec(), n))
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The order in which the training samples are visited: a fresh seeded shuffle per epoch, read
/// as one endless stream. Step `s` of a run with global batch `G` takes stream positions
/// `s*G .. (s+1)*G`; rank `r` takes micro-batch `k` as positions
/// `s*G + (k*N + r)*B .. + B`. The global batch of a step is therefore the same set of samples
/// whatever N, K and B are, as long as N x K x B is the same, which is what makes N ranks
/// equivalent to one rank with the whole batch.
#[derive(Debug)]
pub struct Sampler {
    n: usize,
    seed: u64,
    epoch: Option<u64>,
    perm: Vec<u32>,
}

impl Sampler {
    /// A sampler over `n` samples.
    pub fn new(n: usize, seed: u64) -> Self {
        Sampler {
            n,
            seed,
            epoch: None,
            perm: Vec::new(),
        }
    }

    /// The sample at stream position `pos`.
    pub fn at(&mut self, pos: u64) -> usize {
        let epoch = pos / self.n as u64;
        if self.epoch != Some(epoch) {
            // Fisher-Yates with a generator seeded by (seed, epoch).
            self.perm = (0..self.n as u32).collect();
            let mut state = splitmix(self.seed ^ splitmix(epoch));
            for i in (1..self.n).rev() {
                state = splitmix(state);
                let j = (state % (i as u64 + 1)) as usize;
                self.perm.swap(i, j);
            }
            self.epoch = Some(epoch);
        }
        self.perm[(pos % self.n as u64) as usize] as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idx_headers_are_checked() {
        let mut f = vec![0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 28, 0, 0, 0, 28];
        f.extend(std::iter::repeat_n(7u8, 2 * 784));
        let (data, n) = parse_idx(&f, &[28, 28]).unwrap();
        assert_eq!((n, data.len()), (2, 2 * 784));
        assert!(parse_idx(&f[..f.len() - 1], &[28, 28]).is_err());
        assert!(parse_idx(&f, &[]).is_err());
        assert!(parse_idx(&f[..10], &[28, 28]).is_err());
        let labels = [0, 0, 8, 1, 0, 0, 0, 3, 1, 2, 3];
        assert_eq!(parse_idx(&labels, &[]).unwrap(), (vec![1, 2, 3], 3));
        assert!(parse_idx(&[0, 0, 9, 1, 0, 0, 0, 0], &[]).is_err());
    }

    #[test]
    fn the_stream_is_a_permutation_per_epoch() {
        let mut s = Sampler::new(100, 5);
        let mut seen: Vec<usize> = (0..100).map(|p| s.at(p)).collect();
        let first = seen.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        let second: Vec<usize> = (100..200).map(|p| s.at(p)).collect();
        assert_ne!(first, second);
        // Deterministic, and independent of the access order.
        let mut t = Sampler::new(100, 5);
        assert_eq!(t.at(150), second[50]);
        assert_eq!(t.at(3), first[3]);
    }
}

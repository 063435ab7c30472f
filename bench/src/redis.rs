//! A minimal RESP2 client for the Redis comparison: SET and GET of binary values,
//! single or pipelined. Values are written from the caller's buffer (vectored, no
//! copy into a command buffer) and read straight into the caller's buffer, the same
//! one-copy contract as Maru's `maru_load_batch` into caller buffers.

use crate::harness::{run_clients, Bound, Fig, Rotor};
use std::io::{BufRead, BufReader, IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Resp {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

fn io(e: std::io::Error) -> String {
    format!("redis: {e}")
}

impl Resp {
    pub fn connect(addr: &str) -> Result<Resp, String> {
        let w = TcpStream::connect(addr).map_err(io)?;
        w.set_nodelay(true).map_err(io)?;
        w.set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(io)?;
        let r = BufReader::with_capacity(256 * 1024, w.try_clone().map_err(io)?);
        Ok(Resp { w, r })
    }

    pub fn ping(&mut self) -> Result<(), String> {
        self.command("PING", "+PONG")
    }

    /// Sends the one-word command `cmd` and expects the status line `want`.
    fn command(&mut self, cmd: &str, want: &str) -> Result<(), String> {
        let req = format!("*1\r\n${}\r\n{cmd}\r\n", cmd.len());
        self.w.write_all(req.as_bytes()).map_err(io)?;
        let line = self.line()?;
        if line == want {
            Ok(())
        } else {
            Err(format!("redis: {cmd} answered {line}"))
        }
    }

    fn line(&mut self) -> Result<String, String> {
        let mut s = String::new();
        let n = self.r.read_line(&mut s).map_err(io)?;
        if n == 0 {
            return Err("redis: connection closed".into());
        }
        Ok(s.trim_end().to_string())
    }

    /// Sends `SET key value` for every pair, then reads every reply (one pipeline).
    pub fn set_many(&mut self, items: &[(&str, &[u8])]) -> Result<(), String> {
        let heads: Vec<String> = items
            .iter()
            .map(|(k, v)| {
                format!(
                    "*3\r\n$3\r\nSET\r\n${}\r\n{}\r\n${}\r\n",
                    k.len(),
                    k,
                    v.len()
                )
            })
            .collect();
        let mut slices = Vec::with_capacity(items.len() * 3);
        for (h, (_, v)) in heads.iter().zip(items) {
            slices.push(IoSlice::new(h.as_bytes()));
            slices.push(IoSlice::new(v));
            slices.push(IoSlice::new(b"\r\n"));
        }
        write_all_vectored(&mut self.w, &mut slices)?;
        for _ in items {
            let l = self.line()?;
            if l != "+OK" {
                return Err(format!("redis: SET answered {l}"));
            }
        }
        Ok(())
    }

    /// Sends `GET key` for every key, then reads each value into its buffer; returns
    /// the lengths (None: missing).
    pub fn get_many(
        &mut self,
        keys: &[&str],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<Option<usize>>, String> {
        let mut cmd = Vec::with_capacity(keys.len() * 40);
        for k in keys {
            cmd.extend_from_slice(
                format!("*2\r\n$3\r\nGET\r\n${}\r\n{}\r\n", k.len(), k).as_bytes(),
            );
        }
        self.w.write_all(&cmd).map_err(io)?;
        let mut out = Vec::with_capacity(keys.len());
        for b in bufs.iter_mut() {
            let l = self.line()?;
            let n: i64 = l
                .strip_prefix('$')
                .and_then(|x| x.parse().ok())
                .ok_or_else(|| format!("redis: GET answered {l}"))?;
            if n < 0 {
                out.push(None);
                continue;
            }
            let n = n as usize;
            if n > b.len() {
                return Err(format!("redis: value of {n} bytes, buffer {}", b.len()));
            }
            self.r.read_exact(&mut b[..n]).map_err(io)?;
            let mut crlf = [0u8; 2];
            self.r.read_exact(&mut crlf).map_err(io)?;
            out.push(Some(n));
        }
        Ok(out)
    }
}

fn write_all_vectored(w: &mut TcpStream, mut bufs: &mut [IoSlice<'_>]) -> Result<(), String> {
    // Skip empty slices so that a zero-length write means a closed peer.
    while !bufs.is_empty() {
        let n = w.write_vectored(bufs).map_err(io)?;
        if n == 0 {
            return Err("redis: connection closed while writing".into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

impl Resp {
    pub fn flushall(&mut self) -> Result<(), String> {
        self.command("FLUSHALL", "+OK")
    }
}

/// The four Redis figures of one chunk size and client count.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RedisResult {
    pub chunk: usize,
    pub clients: usize,
    pub set_batch: Fig,
    pub set_single: Fig,
    pub get_batch: Fig,
    pub get_single: Fig,
}

/// SETs `ks`, each with the next piece of `chunk` bytes of `src`, in one pipeline.
fn set_from(r: &mut Resp, ks: &[String], src: &mut Rotor, chunk: usize) -> Result<(), String> {
    let items: Vec<(&str, &[u8])> = ks
        .iter()
        .map(|k| {
            // SAFETY: a piece of `chunk` bytes inside the rotor, read only.
            (k.as_str(), unsafe {
                std::slice::from_raw_parts(src.next_ptr(), chunk)
            })
        })
        .collect();
    r.set_many(&items)
}

/// SET/GET pipelined 32 per batch and single, `clients` connections, each over its own
/// keys (`keyspace` bytes over all clients, so GETs read cold values); SETs overwrite
/// those keys in rotation (Redis frees the old value), from cold source buffers.
pub fn bench(
    addr: &str,
    chunk: usize,
    clients: usize,
    secs: f64,
    keyspace: usize,
) -> Result<RedisResult, String> {
    const BATCH: usize = crate::harness::BATCH;
    Resp::connect(addr)?.flushall()?;
    let keys_per_client = (keyspace / clients / chunk).max(BATCH) / BATCH * BATCH;
    let key = move |c: usize, i: usize| format!("r-{chunk}-{c}-{}", i % keys_per_client);
    let rotate = (keyspace / clients).max(chunk * BATCH * 2);
    let mut conns = Vec::new();
    for c in 0..clients {
        let mut r = Resp::connect(addr)?;
        let mut src = Rotor::new(rotate, chunk, 11 + c as u64);
        for b in 0..keys_per_client / BATCH {
            let ks: Vec<String> = (0..BATCH).map(|j| key(c, b * BATCH + j)).collect();
            set_from(&mut r, &ks, &mut src, chunk)?;
        }
        conns.push(Arc::new(Mutex::new((r, src, Rotor::new(rotate, chunk, 5)))));
    }
    let bound = Bound {
        secs,
        max_ops: usize::MAX,
    };
    let phase = |per_op: usize, set: bool| -> Result<Fig, String> {
        let ops: Vec<_> = (0..clients)
            .map(|c| {
                let conn = conns[c].clone();
                move |i: usize| -> Result<u64, String> {
                    let mut g = conn.lock().map_err(|_| "poisoned")?;
                    let (r, src, dst) = &mut *g;
                    let ks: Vec<String> = (0..per_op).map(|j| key(c, i * per_op + j)).collect();
                    if set {
                        set_from(r, &ks, src, chunk)?;
                        Ok((per_op * chunk) as u64)
                    } else {
                        let kr: Vec<&str> = ks.iter().map(|k| k.as_str()).collect();
                        let mut bufs: Vec<&mut [u8]> = (0..per_op)
                            // SAFETY: distinct pieces of the destination rotor (per_op ≤ its pieces).
                            .map(|_| unsafe {
                                std::slice::from_raw_parts_mut(dst.next_ptr(), chunk)
                            })
                            .collect();
                        let got = r.get_many(&kr, &mut bufs)?;
                        if got.iter().any(|g| g.is_none()) {
                            return Err("redis: a stored key was missing".into());
                        }
                        Ok(got.iter().map(|g| g.unwrap_or(0) as u64).sum())
                    }
                }
            })
            .collect();
        run_clients(ops, bound)
    };
    let set_batch = phase(BATCH, true)?;
    let set_single = phase(1, true)?;
    let get_batch = phase(BATCH, false)?;
    let get_single = phase(1, false)?;
    drop(conns);
    Resp::connect(addr)?.flushall()?;
    Ok(RedisResult {
        chunk,
        clients,
        set_batch,
        set_single,
        get_batch,
        get_single,
    })
}

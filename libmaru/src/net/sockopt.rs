//! Socket options the daemons set on every connection.

use std::os::fd::AsRawFd;

fn set(fd: i32, level: i32, name: i32, value: i32) {
    // SAFETY: a valid fd and a pointer to an int of the stated size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        log::debug!(
            "setsockopt({level}, {name}) failed: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// TCP keepalive 10 s idle, 5 s interval, 3 probes: a peer whose host died is noticed
/// in about 25 s, which starts the owner's grace timer at the RM.
pub fn keepalive(sock: &impl AsRawFd) {
    let fd = sock.as_raw_fd();
    set(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10);
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
    set(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3);
}

/// Reads into `buf` what has already arrived, without blocking: `None` when nothing
/// has (or the call was interrupted), `Some(0)` at the end of the stream.
pub fn recv_now(sock: &impl AsRawFd, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
    // SAFETY: buf is a live, writable buffer of buf.len() bytes; the descriptor is
    // open for the whole call (borrowed from its owner).
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n >= 0 {
        return Ok(Some(n as usize));
    }
    let e = std::io::Error::last_os_error();
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Ok(None),
        _ => Err(e),
    }
}

/// Payloads at least this long are read with a raised receive low-water mark.
const LOWAT_FROM: usize = 128 << 10;
/// The highest low-water mark asked for.
const LOWAT_MAX: usize = 256 << 10;

/// The socket's receive buffer now (bytes), as the kernel's autotuning has sized it.
fn rcvbuf(fd: i32) -> usize {
    let mut v: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: a valid fd and a pointer to an int with its length.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&mut v as *mut i32).cast(),
            &mut len,
        )
    };
    if r == 0 {
        v.max(0) as usize
    } else {
        0
    }
}

/// `read_exact` for bulk payloads: while at least `LOWAT_FROM` bytes are left, the
/// thread sleeps in `poll` with the socket's receive low-water mark raised
/// (`SO_RCVLOWAT`), so that it is woken once per many segments rather than for each;
/// on a VM every wake-up is an inter-processor interrupt and an exit, the largest cost
/// of a loopback stream after the copies. Bytes are taken only without blocking: a
/// `recv` that blocks with a raised mark and has copied part of what it waits for is
/// woken only when the *queued* bytes reach the mark, which the rest of the payload
/// may never do. The mark stays at a quarter of the receive buffer (and at most
/// `LOWAT_MAX`), so the window can always hold it. It is back at one byte on return;
/// the socket's read timeout bounds each wait.
pub fn read_exact_bulk(stream: &std::net::TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind, Read};
    let mut s = stream;
    if buf.len() < LOWAT_FROM {
        return s.read_exact(buf);
    }
    let fd = stream.as_raw_fd();
    let timeout_ms = match stream.read_timeout()? {
        Some(t) => t.as_millis().clamp(1, i32::MAX as u128) as i32,
        None => -1,
    };
    let cap = (rcvbuf(fd) / 4).clamp(1, LOWAT_MAX);
    let mut mark = 1;
    let mut got = 0;
    let r = loop {
        if got == buf.len() {
            break Ok(());
        }
        match recv_now(stream, &mut buf[got..]) {
            Ok(Some(0)) => break Err(ErrorKind::UnexpectedEof.into()),
            Ok(Some(n)) => {
                got += n;
                continue;
            }
            Ok(None) => {}
            Err(e) => break Err(e),
        }
        let want = (buf.len() - got).min(cap);
        if want != mark {
            set(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, want as i32);
            mark = want;
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut p, 1, timeout_ms) } {
            0 => {
                break Err(Error::new(
                    ErrorKind::TimedOut,
                    "no bytes within the read timeout",
                ))
            }
            n if n < 0 => {
                let e = Error::last_os_error();
                if e.kind() != ErrorKind::Interrupted {
                    break Err(e);
                }
            }
            // Readable, closed or failed: the next recv tells which.
            _ => {}
        }
    };
    if mark != 1 {
        set(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, 1);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{ErrorKind, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (b, _) = l.accept().expect("accept");
        (a, b)
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    /// Each payload comes in two pieces with a pause between, so that the first piece
    /// is queued before the reader waits for the rest: a blocking read with the mark
    /// raised copies it, then waits for the queued bytes to reach the mark, which the
    /// rest alone never does. The receive buffer is large, so the mark is at its most.
    #[test]
    fn bulk_reads_get_every_byte_of_payloads_sent_in_pieces() {
        let (mut tx, rx) = pair();
        set(rx.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, 8 << 20);
        assert!(
            rcvbuf(rx.as_raw_fd()) / 4 >= LOWAT_MAX,
            "a large receive buffer"
        );
        rx.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let sizes = [LOWAT_MAX, LOWAT_MAX, 300 << 10, 2 << 20, LOWAT_FROM, 1000];
        let sent: Vec<Vec<u8>> = sizes.iter().map(|&n| pattern(n)).collect();
        let to_send = sent.clone();
        let writer = std::thread::spawn(move || {
            for p in &to_send {
                let (a, b) = p.split_at(p.len() / 3);
                tx.write_all(a).expect("write");
                std::thread::sleep(Duration::from_millis(20));
                tx.write_all(b).expect("write");
                std::thread::sleep(Duration::from_millis(5));
            }
            tx
        });
        for p in &sent {
            let mut got = vec![0u8; p.len()];
            read_exact_bulk(&rx, &mut got).expect("read");
            assert!(
                got == *p,
                "a payload of {} bytes came back changed",
                p.len()
            );
        }
        let mut tx = writer.join().expect("writer");
        // The mark is back at one byte: a single byte is read at once.
        tx.write_all(&[9]).expect("write");
        let mut one = [0u8; 1];
        read_exact_bulk(&rx, &mut one).expect("read");
        assert_eq!(one, [9]);
    }

    #[test]
    fn a_bulk_read_ends_with_the_peer_or_the_read_timeout() {
        let (mut tx, rx) = pair();
        rx.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        tx.write_all(&pattern(200 << 10)).expect("write");
        drop(tx);
        let mut buf = vec![0u8; 1 << 20];
        let e = read_exact_bulk(&rx, &mut buf).expect_err("the peer closed mid-payload");
        assert_eq!(e.kind(), ErrorKind::UnexpectedEof);

        let (mut tx, rx) = pair();
        rx.set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        tx.write_all(&pattern(100 << 10)).expect("write");
        let started = std::time::Instant::now();
        let e = read_exact_bulk(&rx, &mut buf).expect_err("the rest never comes");
        assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(tx);
    }
}

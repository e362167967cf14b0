//! TCP links: TCP_NODELAY, big socket buffers, non-blocking reads that busy-poll for the
//! adaptive spin budget and then block in poll(2) until the deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::Fault;
use crate::link::{Deadline, Link, SpinPolicy};

/// Socket buffers large enough that one collective segment never blocks a writer.
const SOCKET_BUFFER: usize = 4 << 20;

pub struct TcpLink {
    stream: TcpStream,
    spin: SpinPolicy,
}

impl TcpLink {
    pub fn new(stream: TcpStream, spin: Duration) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        let s = socket2::SockRef::from(&stream);
        // Best effort: the kernel may cap these, which only costs speed.
        let _ = s.set_send_buffer_size(SOCKET_BUFFER);
        let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
        stream.set_nonblocking(true)?;
        Ok(TcpLink {
            stream,
            spin: SpinPolicy::new(spin),
        })
    }

    /// Blocks in poll(2) until the socket is ready for `events`, or the deadline.
    fn poll(&self, events: libc::c_short, deadline: &mut Deadline) -> Result<(), Fault> {
        let left = deadline.left()?;
        let mut pfd = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, 100) as libc::c_int;
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(Fault::Io(e));
            }
        }
        Ok(())
    }
}

impl Link for TcpLink {
    fn write_all(&mut self, mut bytes: &[u8], deadline: &mut Deadline) -> Result<(), Fault> {
        while !bytes.is_empty() {
            match self.stream.write(bytes) {
                Ok(0) => return Err(Fault::Closed),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    self.poll(libc::POLLOUT, deadline)?
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if is_reset(&e) => return Err(Fault::Closed),
                Err(e) => return Err(Fault::Io(e)),
            }
        }
        Ok(())
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: &mut Deadline) -> Result<(), Fault> {
        let mut got = 0;
        let mut spin_from: Option<Instant> = None;
        let mut blocked = false;
        while got < buf.len() {
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(Fault::Closed),
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let start = *spin_from.get_or_insert_with(Instant::now);
                    let waited = start.elapsed();
                    if !blocked && waited < self.spin.budget() {
                        crate::link::pause(waited);
                        continue;
                    }
                    blocked = true;
                    self.poll(libc::POLLIN, deadline)?;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if is_reset(&e) => return Err(Fault::Closed),
                Err(e) => return Err(Fault::Io(e)),
            }
        }
        if spin_from.is_some() {
            self.spin.record(!blocked);
        }
        Ok(())
    }

    fn kind(&self) -> &'static str {
        "tcp"
    }
}

fn is_reset(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
    )
}

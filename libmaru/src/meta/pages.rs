//! Pages of one region: a FIFO of free page indices and the set of allocated ones.
//!
//! FIFO order hands out the page freed longest ago, so a page is reused as late as
//! possible after its key went. A page is freed only if it is allocated: a double
//! free is refused instead of putting the page on the list twice (which would hand
//! it to two writers).
//!
//! With a durable directory, pages are also *reserved* for the region's session in
//! blocks ahead of need: a reserved page counts as allocated in the region's record
//! (so a restart never hands it to anyone), but not as handed out (no key may be
//! published into it, nobody may free it). [`take_reserved`](PageAllocator::take_reserved)
//! hands one out, once the batch that recorded its reservation is durable.

use std::collections::VecDeque;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// The region has no such page.
    #[error("page {page} is out of range (the region has {pages} pages)")]
    OutOfRange { page: u64, pages: u64 },
    /// The page is free already.
    #[error("page {page} is not allocated (freed twice?)")]
    NotAllocated { page: u64 },
}

/// What a page is now: each is in exactly one state, so whether a page may be put
/// back or freed is one look, not a walk of the free list (issue 46).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageState {
    /// On the free list.
    Free,
    /// Handed out (or holding a recovered key).
    Allocated,
    /// Reserved for the region's session, not handed out.
    Reserved,
    /// Freed with [`free_later`](PageAllocator::free_later), not put back yet.
    Held,
}

#[derive(Debug, Clone)]
pub struct PageAllocator {
    free: VecDeque<u64>,
    state: Vec<PageState>,
    used: u64,
    /// Pages freed with `free_later`, not yet put back.
    held: u64,
    /// Pages reserved (not handed out), in the order reserved, each with the tag the
    /// caller gave (the batch that records the reservation).
    reserve: VecDeque<(u64, u64)>,
}

impl PageAllocator {
    /// A region of `pages` pages, all free, handed out in index order first.
    pub fn new(pages: u64) -> PageAllocator {
        PageAllocator {
            free: (0..pages).collect(),
            state: vec![PageState::Free; pages as usize],
            used: 0,
            held: 0,
            reserve: VecDeque::new(),
        }
    }

    pub fn pages(&self) -> u64 {
        self.state.len() as u64
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    /// Pages allocated, or freed and not handed out again yet (see
    /// [`free_later`](Self::free_later)): the region is in use while any is.
    pub fn in_use(&self) -> u64 {
        self.used + self.held
    }

    pub fn free_count(&self) -> u64 {
        self.free.len() as u64
    }

    fn state_of(&self, page: u64) -> Option<PageState> {
        usize::try_from(page)
            .ok()
            .and_then(|i| self.state.get(i))
            .copied()
    }

    fn set(&mut self, page: u64, state: PageState) {
        self.state[page as usize] = state;
    }

    /// The free page freed longest ago, now allocated.
    pub fn alloc(&mut self) -> Option<u64> {
        let page = self.free.pop_front()?;
        self.set(page, PageState::Allocated);
        self.used += 1;
        Some(page)
    }

    pub fn is_allocated(&self, page: u64) -> bool {
        self.state_of(page) == Some(PageState::Allocated)
    }

    /// Whether `page` could be freed now (what [`free`](Self::free) would say).
    pub fn check_free(&self, page: u64) -> Result<(), PageError> {
        match self.state_of(page) {
            None => Err(PageError::OutOfRange {
                page,
                pages: self.pages(),
            }),
            Some(PageState::Allocated) => Ok(()),
            Some(_) => Err(PageError::NotAllocated { page }),
        }
    }

    pub fn free(&mut self, page: u64) -> Result<(), PageError> {
        self.check_free(page)?;
        self.set(page, PageState::Free);
        self.used -= 1;
        self.free.push_back(page);
        Ok(())
    }

    /// Reserves up to `count` free pages (see the [module docs](self)), tagged
    /// `tag`; returns how many.
    pub fn reserve(&mut self, count: u64, tag: u64) -> u64 {
        let mut n = 0;
        while n < count {
            let Some(page) = self.free.pop_front() else {
                break;
            };
            self.set(page, PageState::Reserved);
            self.reserve.push_back((page, tag));
            n += 1;
        }
        n
    }

    /// Hands out the page reserved first, if its tag is at most `upto` (tags are
    /// given in order: the batches of the reservations).
    pub fn take_reserved(&mut self, upto: u64) -> Option<u64> {
        let &(page, tag) = self.reserve.front()?;
        if tag > upto {
            return None;
        }
        self.reserve.pop_front();
        self.set(page, PageState::Allocated);
        self.used += 1;
        Some(page)
    }

    /// Pages reserved and not handed out.
    pub fn reserved(&self) -> u64 {
        self.reserve.len() as u64
    }

    /// Frees `page` but keeps it out of the free list until
    /// [`put_back`](Self::put_back): its key's removal is not durable yet, and a
    /// page handed out again before it is could be rewritten under a key a restart
    /// brings back.
    pub fn free_later(&mut self, page: u64) -> Result<(), PageError> {
        self.check_free(page)?;
        self.set(page, PageState::Held);
        self.used -= 1;
        self.held += 1;
        Ok(())
    }

    /// A page freed with [`free_later`](Self::free_later) may be handed out again
    /// (any other page is left as it is).
    pub fn put_back(&mut self, page: u64) {
        if self.state_of(page) != Some(PageState::Held) {
            return;
        }
        self.set(page, PageState::Free);
        self.held -= 1;
        self.free.push_back(page);
    }

    /// The pages allocated or reserved, in index order (what a record keeps: a
    /// restart hands none of them out again).
    pub fn allocated_pages(&self) -> Vec<u64> {
        (0..self.pages())
            .filter(|&p| {
                matches!(
                    self.state[p as usize],
                    PageState::Allocated | PageState::Reserved
                )
            })
            .collect()
    }

    /// A region of `pages` pages of which `allocated` are taken (recovery); the
    /// others are free, in index order. Pages out of range are ignored. A page that
    /// was reserved comes back allocated: whether it was handed out before the crash
    /// is not known, so it is never handed out again (its session frees it, or it
    /// goes with the region).
    pub fn restore(pages: u64, allocated: &[u64]) -> PageAllocator {
        let mut state = vec![PageState::Free; pages as usize];
        for &p in allocated {
            if let Some(t) = usize::try_from(p).ok().and_then(|i| state.get_mut(i)) {
                *t = PageState::Allocated;
            }
        }
        let used = state.iter().filter(|t| **t == PageState::Allocated).count() as u64;
        PageAllocator {
            free: (0..pages)
                .filter(|&p| state[p as usize] == PageState::Free)
                .collect(),
            state,
            used,
            held: 0,
            reserve: VecDeque::new(),
        }
    }

    /// Marks a free page allocated (a recovered key sits in it).
    pub fn take(&mut self, page: u64) -> bool {
        if self.state_of(page) != Some(PageState::Free) {
            return false;
        }
        self.set(page, PageState::Allocated);
        self.used += 1;
        self.free.retain(|&p| p != page);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_come_back_in_fifo_order() {
        let mut p = PageAllocator::new(3);
        assert_eq!(
            (p.alloc(), p.alloc(), p.alloc(), p.alloc()),
            (Some(0), Some(1), Some(2), None)
        );
        p.free(1).unwrap();
        p.free(0).unwrap();
        assert_eq!(p.alloc(), Some(1), "the page freed first comes first");
        assert_eq!(p.alloc(), Some(0));
        assert_eq!((p.used(), p.free_count()), (3, 0));
    }

    #[test]
    fn a_double_free_is_refused_and_changes_nothing() {
        let mut p = PageAllocator::new(2);
        let a = p.alloc().unwrap();
        p.free(a).unwrap();
        assert_eq!(p.free(a), Err(PageError::NotAllocated { page: a }));
        assert_eq!(p.free_count(), 2, "the page is on the free list once");
        assert_eq!(p.alloc(), Some(1));
        assert_eq!(p.alloc(), Some(0));
        assert_eq!(p.alloc(), None);
    }

    #[test]
    fn a_page_freed_later_is_handed_out_only_once_put_back() {
        let mut p = PageAllocator::new(2);
        let a = p.alloc().unwrap();
        let b = p.alloc().unwrap();
        p.free_later(a).unwrap();
        assert_eq!(p.free_later(a), Err(PageError::NotAllocated { page: a }));
        assert_eq!(p.alloc(), None, "not back yet");
        p.put_back(a);
        p.put_back(a);
        assert_eq!(p.alloc(), Some(a));
        assert_eq!(p.alloc(), None, "put back once");
        let r = PageAllocator::restore(3, &[b, 9]);
        assert_eq!(
            (r.used(), r.free_count(), r.allocated_pages()),
            (1, 2, vec![b])
        );
    }

    #[test]
    fn reserved_pages_are_recorded_but_handed_out_only_up_to_the_durable_tag() {
        let mut p = PageAllocator::new(4);
        assert_eq!(p.reserve(2, 7), 2);
        assert_eq!(p.reserve(1, 8), 1);
        assert_eq!(p.allocated_pages(), vec![0, 1, 2], "a record keeps them");
        assert!(!p.is_allocated(0), "not handed out: no publish, no free");
        assert_eq!(p.check_free(0), Err(PageError::NotAllocated { page: 0 }));
        assert_eq!((p.used(), p.in_use(), p.reserved()), (0, 0, 3));
        assert_eq!(p.take_reserved(6), None, "its batch is not durable");
        assert_eq!(p.take_reserved(7), Some(0));
        assert_eq!(p.take_reserved(7), Some(1));
        assert_eq!(p.take_reserved(7), None);
        assert_eq!(p.alloc(), Some(3), "a direct alloc skips the reserve");
        assert_eq!(p.alloc(), None);
        p.put_back(2);
        assert_eq!(
            p.alloc(),
            None,
            "a reserved page is never put on the free list"
        );
        assert_eq!(p.take_reserved(u64::MAX), Some(2));
        assert_eq!((p.used(), p.reserved()), (4, 0));
        // A restart: every recorded page is taken, none reserved.
        let r = PageAllocator::restore(4, &[0, 2]);
        assert_eq!((r.used(), r.reserved(), r.free_count()), (2, 0, 2));
    }

    /// `put_back` acts on a page freed later only, whatever else the page is: one
    /// look at its state (it walked the free list, issue 46).
    #[test]
    fn only_a_page_freed_later_is_put_back() {
        let mut p = PageAllocator::new(4);
        let (a, b, c) = (p.alloc().unwrap(), p.alloc().unwrap(), p.alloc().unwrap());
        p.free(a).unwrap();
        p.put_back(a);
        p.put_back(b);
        p.put_back(99);
        assert_eq!(p.reserve(1, 1), 1);
        p.put_back(3);
        assert_eq!((p.used(), p.in_use(), p.free_count()), (2, 2, 1));
        p.free_later(c).unwrap();
        assert_eq!((p.used(), p.in_use(), p.free_count()), (1, 2, 1));
        p.put_back(c);
        assert_eq!((p.used(), p.in_use(), p.free_count()), (1, 1, 2));
        assert_eq!((p.alloc(), p.alloc(), p.alloc()), (Some(a), Some(c), None));
        assert!(p.take_reserved(1).is_some() && p.is_allocated(b));
    }

    #[test]
    fn out_of_range_pages_are_refused() {
        let mut p = PageAllocator::new(2);
        assert_eq!(p.free(2), Err(PageError::OutOfRange { page: 2, pages: 2 }));
        assert_eq!(
            p.free(u64::MAX),
            Err(PageError::OutOfRange {
                page: u64::MAX,
                pages: 2
            })
        );
        assert!(!p.is_allocated(u64::MAX));
    }
}

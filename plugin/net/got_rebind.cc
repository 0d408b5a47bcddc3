#include "plugin/net/got_rebind.h"

#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <exception>
#include <unordered_map>

namespace lgreco::net {

#if defined(__x86_64__)
constexpr uint32_t kJumpSlot = R_X86_64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
constexpr uint32_t kJumpSlot = R_AARCH64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_AARCH64_GLOB_DAT;
#else
#error "lgreco's GOT rebinding (plugin/net/got_rebind.cc) knows the relocation types of x86-64 and aarch64 only"
#endif
static_assert(sizeof(void*) == 8, "x86-64 and aarch64 are ELF64 targets");
// r_info's halves (ELF64_R_TYPE / ELF64_R_SYM, as functions for the templates below).
constexpr uint32_t rel_type(uint64_t info) { return static_cast<uint32_t>(ELF64_R_TYPE(info)); }
constexpr size_t rel_symbol(uint64_t info) { return static_cast<size_t>(ELF64_R_SYM(info)); }

namespace {

// A malformed hash chain must not spin forever: no real object has this many symbols in
// one bucket (libtorch_cuda.so has about 10^5 dynamic symbols in all).
constexpr size_t kMaxChain = size_t{1} << 22;

std::string errno_text(int err) { return std::string(strerror(err)); }

std::string object_name(const std::string& path) { return path.empty() ? std::string("the main program") : path; }

// The protection of each mapping of the process, read from /proc/self/maps when a slot in
// a page that may be read-only is about to be written.
struct Mapping {
  uintptr_t start = 0, end = 0;
  int prot = 0;
};

bool read_mappings(std::vector<Mapping>* out, std::string* error) {
  out->clear();
  FILE* f = fopen("/proc/self/maps", "re");
  if (!f) {
    *error = "cannot open /proc/self/maps: " + errno_text(errno);
    return false;
  }
  char line[4096];
  // One line per mapping; a line longer than the buffer (a long path) continues in the
  // next fgets, which does not parse as a mapping and is skipped.
  while (fgets(line, sizeof line, f)) {
    uintptr_t start = 0, end = 0;
    char perms[5] = {};
    if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %4s", &start, &end, perms) != 3) continue;
    Mapping m{start, end, PROT_NONE};
    if (perms[0] == 'r') m.prot |= PROT_READ;
    if (perms[1] == 'w') m.prot |= PROT_WRITE;
    if (perms[2] == 'x') m.prot |= PROT_EXEC;
    out->push_back(m);
  }
  fclose(f);
  return true;
}

const Mapping* find_mapping(const std::vector<Mapping>& maps, uintptr_t address) {
  for (const Mapping& m : maps)
    if (address >= m.start && address < m.end) return &m;
  return nullptr;
}

uint32_t gnu_hash(std::string_view name) {
  uint32_t h = 5381;
  for (unsigned char c : name) h = h * 33 + c;
  return h;
}

uint32_t sysv_hash(std::string_view name) {
  uint32_t h = 0;
  for (unsigned char c : name) {
    h = (h << 4) + c;
    const uint32_t g = h & 0xf0000000u;
    if (g) h ^= g >> 24;
    h &= ~g;
  }
  return h;
}

struct PassState {
  const std::vector<Rebinding>* wanted = nullptr;
  std::unordered_map<std::string_view, size_t> index;  // name -> position in wanted
  const std::function<bool(const LoadedObject&)>* skip = nullptr;
  RebindReport* report = nullptr;
  std::vector<Mapping> maps;
  bool maps_read = false;
  long page_size = 4096;
};

}  // namespace

// Reads one object's dynamic section and rewrites its matching slots.
struct ObjectScan {
  LoadedObject object;
  const ElfW(Phdr)* phdrs = nullptr;
  const ElfW(Dyn)* dynamic = nullptr;
  size_t dynamic_count = 0;
  uintptr_t relro_start = 0, relro_end = 0;
  PassState* state = nullptr;
  ObjectRebinds result;
  std::vector<uintptr_t> seen_slots;  // DT_RELA may overlap DT_JMPREL: count a slot once

  bool init(const dl_phdr_info* info, PassState* pass) {
    state = pass;
    object.path_ = info->dlpi_name ? info->dlpi_name : "";
    object.base_ = info->dlpi_addr;
    object.phdrs_ = info->dlpi_phdr;
    object.phnum_ = info->dlpi_phnum;
    phdrs = info->dlpi_phdr;
    for (size_t i = 0; i < object.phnum_; ++i) {
      const ElfW(Phdr)& ph = phdrs[i];
      if (ph.p_type == PT_DYNAMIC) {
        dynamic = reinterpret_cast<const ElfW(Dyn)*>(object.base_ + ph.p_vaddr);
        dynamic_count = ph.p_memsz / sizeof(ElfW(Dyn));
      } else if (ph.p_type == PT_GNU_RELRO) {
        relro_start = object.base_ + ph.p_vaddr;
        relro_end = relro_start + ph.p_memsz;
      }
    }
    return dynamic != nullptr;  // a static object has nothing to rebind
  }

  // A d_ptr as an address. glibc adjusts the dynamic section's pointers by the load bias
  // in place, other loaders (and glibc for the vdso) leave them as offsets: an address
  // below the bias cannot be a relocated pointer of this object.
  const void* pointer(uintptr_t value) const {
    return reinterpret_cast<const void*>(value < object.base_ ? object.base_ + value : value);
  }

  // Fills the tables the symbol lookups need; false (with an error) if they are unusable.
  bool read_dynamic(std::string* error) {
    for (size_t i = 0; i < dynamic_count && dynamic[i].d_tag != DT_NULL; ++i) {
      const ElfW(Dyn)& d = dynamic[i];
      switch (d.d_tag) {
        case DT_SYMTAB: object.symtab_ = pointer(d.d_un.d_ptr); break;
        case DT_STRTAB: object.strtab_ = static_cast<const char*>(pointer(d.d_un.d_ptr)); break;
        case DT_STRSZ: object.strsz_ = d.d_un.d_val; break;
        case DT_GNU_HASH: object.gnu_hash_ = static_cast<const uint32_t*>(pointer(d.d_un.d_ptr)); break;
        case DT_HASH: object.sysv_hash_ = static_cast<const uint32_t*>(pointer(d.d_un.d_ptr)); break;
        default: break;
      }
    }
    if (!object.symtab_ && !object.strtab_) return true;  // no dynamic symbols at all
    if (!object.symtab_ || !object.strtab_ || !object.contains(object.symtab_) || !object.contains(object.strtab_)) {
      *error = object_name(object.path_) + ": DT_SYMTAB or DT_STRTAB missing or outside the object";
      return false;
    }
    if (object.gnu_hash_ && !object.contains(object.gnu_hash_)) object.gnu_hash_ = nullptr;
    if (object.sysv_hash_ && !object.contains(object.sysv_hash_)) object.sysv_hash_ = nullptr;
    return true;
  }

  uintptr_t dyn_value(ElfW(Sxword) tag, bool* found) const {
    for (size_t i = 0; i < dynamic_count && dynamic[i].d_tag != DT_NULL; ++i)
      if (dynamic[i].d_tag == tag) {
        *found = true;
        return dynamic[i].d_un.d_val;
      }
    *found = false;
    return 0;
  }

  // One relocation table of `bytes` bytes; Rel is ElfW(Rela) or ElfW(Rel).
  template <typename Rel>
  bool scan_table(const void* table, size_t bytes, std::string* error) {
    if (!table || bytes == 0) return true;
    const auto* rels = static_cast<const Rel*>(table);
    const size_t n = bytes / sizeof(Rel);
    if (!object.contains(rels) || !object.contains(reinterpret_cast<const char*>(rels + n) - 1)) {
      *error = object_name(object.path_) + ": a relocation table lies outside the object";
      return false;
    }
    const auto* symtab = static_cast<const ElfW(Sym)*>(object.symtab_);
    for (size_t i = 0; i < n; ++i) {
      const uint32_t type = rel_type(rels[i].r_info);
      if (type != kJumpSlot && type != kGlobDat) continue;
      const size_t sym = rel_symbol(rels[i].r_info);
      if (sym == 0 || !symtab) continue;
      const ElfW(Sym)* s = symtab + sym;
      if (!object.contains(s) || s->st_name >= object.strsz_) {
        *error = object_name(object.path_) + ": relocation " + std::to_string(i) + " names a symbol outside its tables";
        return false;
      }
      const char* name = object.strtab_ + s->st_name;
      const auto it = state->index.find(std::string_view(name, strnlen(name, object.strsz_ - s->st_name)));
      if (it == state->index.end()) continue;
      const uintptr_t slot = object.base_ + rels[i].r_offset;
      if (!object.contains(reinterpret_cast<const void*>(slot)) || slot % sizeof(void*) != 0) {
        *error = object_name(object.path_) + ": the GOT slot of " + std::string(name) + " lies outside the object";
        return false;
      }
      bool duplicate = false;
      for (uintptr_t seen : seen_slots) duplicate |= seen == slot;
      if (duplicate) continue;
      seen_slots.push_back(slot);
      if (!write_slot(slot, (*state->wanted)[it->second].replacement, name, error)) return false;
      ++state->report->imports[it->second];
      const std::string n_str(name);
      bool listed = false;
      for (const std::string& known : result.names) listed |= known == n_str;
      if (!listed) result.names.push_back(n_str);
    }
    return true;
  }

  bool write_slot(uintptr_t slot, const void* replacement, const char* name, std::string* error) {
    auto* p = reinterpret_cast<const void**>(slot);
    // Another thread may call through this slot right now: read and write it as one
    // aligned word, never torn.
    if (__atomic_load_n(p, __ATOMIC_ACQUIRE) == replacement) {
      ++result.already;
      return true;
    }
    const uintptr_t page = slot & ~static_cast<uintptr_t>(state->page_size - 1);
    int prot = PROT_READ | PROT_WRITE;
    if (may_be_read_only(slot)) {
      const Mapping* m = state->maps_read ? find_mapping(state->maps, slot) : nullptr;
      if (!m) {  // first read-only candidate of this pass, or a mapping newer than our copy
        std::string maps_error;
        if (!read_mappings(&state->maps, &maps_error)) {
          *error = object_name(object.path_) + ": " + maps_error;
          return false;
        }
        state->maps_read = true;
        m = find_mapping(state->maps, slot);
      }
      if (!m) {
        *error = object_name(object.path_) + ": the GOT slot of " + name + " is in no mapping of /proc/self/maps";
        return false;
      }
      prot = m->prot;
    }
    const bool unprotect = !(prot & PROT_WRITE);
    if (unprotect && mprotect(reinterpret_cast<void*>(page), state->page_size, prot | PROT_WRITE) != 0) {
      *error = object_name(object.path_) + ": cannot make the GOT page of " + name + " writable: " + errno_text(errno);
      return false;
    }
    __atomic_store_n(p, replacement, __ATOMIC_RELEASE);
    ++result.rewritten;
    if (unprotect && mprotect(reinterpret_cast<void*>(page), state->page_size, prot) != 0) {
      *error = object_name(object.path_) + ": rebound " + name + " but cannot make its GOT page read-only again: " +
               errno_text(errno);
      return false;
    }
    return true;
  }

  // A slot outside PT_GNU_RELRO in a writable PT_LOAD segment stays writable for the
  // object's life (the lazy-binding .got.plt); anything else may have been made read-only.
  bool may_be_read_only(uintptr_t slot) const {
    if (slot >= relro_start && slot < relro_end) return true;
    for (size_t i = 0; i < object.phnum_; ++i) {
      const ElfW(Phdr)& ph = phdrs[i];
      const uintptr_t start = object.base_ + ph.p_vaddr;
      if (ph.p_type == PT_LOAD && slot >= start && slot < start + ph.p_memsz) return !(ph.p_flags & PF_W);
    }
    return true;
  }

  // After read_dynamic.
  bool scan(std::string* error) {
    if (!object.symtab_) return true;
    bool found = false;
    const uintptr_t jmprel = dyn_value(DT_JMPREL, &found);
    const size_t pltrelsz = found ? dyn_value(DT_PLTRELSZ, &found) : 0;
    const uintptr_t pltrel = pltrelsz ? dyn_value(DT_PLTREL, &found) : 0;
    if (pltrelsz) {
      if (pltrel == DT_RELA) {
        if (!scan_table<ElfW(Rela)>(pointer(jmprel), pltrelsz, error)) return false;
      } else if (pltrel == DT_REL) {
        if (!scan_table<ElfW(Rel)>(pointer(jmprel), pltrelsz, error)) return false;
      } else {
        *error = object_name(object.path_) + ": DT_PLTREL is neither DT_RELA nor DT_REL";
        return false;
      }
    }
    if (const uintptr_t rela = dyn_value(DT_RELA, &found); found) {
      const size_t size = dyn_value(DT_RELASZ, &found);
      if (!scan_table<ElfW(Rela)>(pointer(rela), found ? size : 0, error)) return false;
    }
    if (const uintptr_t rel = dyn_value(DT_REL, &found); found) {
      const size_t size = dyn_value(DT_RELSZ, &found);
      if (!scan_table<ElfW(Rel)>(pointer(rel), found ? size : 0, error)) return false;
    }
    return true;
  }
};

bool LoadedObject::contains(const void* address) const {
  const auto a = reinterpret_cast<uintptr_t>(address);
  const auto* phdrs = static_cast<const ElfW(Phdr)*>(phdrs_);
  for (size_t i = 0; i < phnum_; ++i) {
    if (phdrs[i].p_type != PT_LOAD) continue;
    const uintptr_t start = base_ + phdrs[i].p_vaddr;
    if (a >= start && a < start + phdrs[i].p_memsz) return true;
  }
  return false;
}

bool LoadedObject::defines(std::string_view symbol) const {
  if (!symtab_ || !strtab_) return false;
  const auto* symtab = static_cast<const ElfW(Sym)*>(symtab_);
  auto matches = [&](size_t index) {
    const ElfW(Sym)* s = symtab + index;
    if (!contains(s) || s->st_name >= strsz_ || s->st_shndx == SHN_UNDEF) return false;
    const char* name = strtab_ + s->st_name;
    return symbol == std::string_view(name, strnlen(name, strsz_ - s->st_name));
  };
  if (gnu_hash_) {
    // DT_GNU_HASH: nbuckets, symoffset, bloom words, bloom shift, the bloom filter
    // (ElfW(Addr) words), the buckets, then one hash value per symbol from symoffset on,
    // the last of each chain with its low bit set.
    const uint32_t nbuckets = gnu_hash_[0], symoffset = gnu_hash_[1], bloom_words = gnu_hash_[2];
    if (nbuckets == 0) return false;
    const auto* buckets = reinterpret_cast<const uint32_t*>(
        reinterpret_cast<const ElfW(Addr)*>(gnu_hash_ + 4) + bloom_words);
    const uint32_t* chain = buckets + nbuckets;
    const uint32_t h = gnu_hash(symbol);
    const uint32_t first = buckets[h % nbuckets];
    if (!contains(buckets + nbuckets - 1) || first < symoffset) return false;
    for (size_t i = first, steps = 0; steps < kMaxChain; ++i, ++steps) {
      const uint32_t* hv = chain + (i - symoffset);
      if (!contains(hv)) return false;
      if ((*hv | 1) == (h | 1) && matches(i)) return true;
      if (*hv & 1) return false;
    }
    return false;
  }
  if (sysv_hash_) {
    // DT_HASH: nbucket, nchain, the buckets, the chains; index 0 ends a chain.
    const uint32_t nbucket = sysv_hash_[0], nchain = sysv_hash_[1];
    if (nbucket == 0) return false;
    const uint32_t* bucket = sysv_hash_ + 2;
    const uint32_t* chain = bucket + nbucket;
    if (!contains(chain + nchain - 1)) return false;
    size_t steps = 0;
    for (uint32_t i = bucket[sysv_hash(symbol) % nbucket]; i != 0 && i < nchain && steps <= nchain; i = chain[i], ++steps)
      if (matches(i)) return true;
  }
  return false;
}

size_t RebindReport::rewritten() const {
  size_t n = 0;
  for (const ObjectRebinds& o : objects) n += o.rewritten;
  return n;
}

namespace {

int visit_object(dl_phdr_info* info, size_t, void* data) {
  auto* state = static_cast<PassState*>(data);
  // Nothing may unwind through the dynamic loader's C frames.
  try {
    ObjectScan scan;
    if (!scan.init(info, state)) return 0;
    std::string error;
    // The skip predicate needs the symbol tables (defines()), so they are read first; a
    // skipped object's malformed tables are not an error worth reporting.
    const bool tables_ok = scan.read_dynamic(&error);
    if ((*state->skip)(scan.object)) {
      ++state->report->objects_skipped;
      return 0;
    }
    ++state->report->objects_scanned;
    if (!tables_ok || !scan.scan(&error)) state->report->errors.push_back(error);
    if (scan.result.rewritten + scan.result.already > 0) {
      scan.result.path = scan.object.path();
      state->report->objects.push_back(std::move(scan.result));
    }
    return 0;
  } catch (const std::exception& e) {
    try {
      state->report->errors.push_back(std::string("GOT rebinding stopped: ") + e.what());
    } catch (...) {
    }
    return 1;  // stop the walk
  } catch (...) {
    return 1;
  }
}

}  // namespace

RebindReport rebind_imports(const std::vector<Rebinding>& wanted,
                            const std::function<bool(const LoadedObject&)>& skip) noexcept {
  RebindReport report;
  try {
    PassState state;
    state.wanted = &wanted;
    state.skip = &skip;
    state.report = &report;
    state.page_size = sysconf(_SC_PAGESIZE);
    if (state.page_size <= 0) state.page_size = 4096;
    report.imports.assign(wanted.size(), 0);
    for (size_t i = 0; i < wanted.size(); ++i) {
      if (!wanted[i].replacement) {
        report.errors.push_back("no replacement for " + wanted[i].name + ": nothing rebound");
        return report;
      }
      state.index.emplace(wanted[i].name, i);
    }
    dl_iterate_phdr(visit_object, &state);
  } catch (const std::exception& e) {
    try {
      report.errors.push_back(std::string("GOT rebinding failed: ") + e.what());
    } catch (...) {
    }
  }
  return report;
}

}  // namespace lgreco::net

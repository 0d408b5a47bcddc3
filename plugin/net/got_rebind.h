// Rewriting other objects' imports of a function in a running process: for every loaded
// ELF object, the GOT slots that its dynamic relocations bind to a symbol name get a new
// address. This is the ELF half of the net plugin's loader (plugin/net/loader.h says why
// it is needed); it knows nothing of NCCL.
//
// What is rewritten: JUMP_SLOT relocations (calls through the PLT, lazy or bound at load
// with -z now) and GLOB_DAT relocations (a function's address taken in code, and calls
// compiled with -fno-plt), from DT_JMPREL and DT_RELA / DT_REL. Not reached: absolute data
// relocations (a function pointer in an initialised table), copies of an address the
// program made before the rewrite, and calls through dlsym.
//
// Slots in a read-only page (full RELRO: -z now -z relro) are made writable for the write
// and given back the protection /proc/self/maps showed for them just before: the page's
// actual state, because an object another thread is loading right now is already on the
// list but not yet relocated, and making its GOT read-only under its own relocation would
// crash that thread.
//
// The whole pass runs inside dl_iterate_phdr's callback, which holds the dynamic loader's
// list lock: no object can be unloaded while its GOT is being written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace lgreco::net {

// One import to redirect: every slot bound to `name` gets `replacement`.
struct Rebinding {
  std::string name;
  const void* replacement = nullptr;
};

// A loaded object as the skip predicate sees it. Valid only during the predicate's call.
class LoadedObject {
 public:
  // The object's file name as the dynamic loader knows it ("" for the main program).
  const std::string& path() const { return path_; }
  // Whether the address lies in one of the object's loaded segments.
  bool contains(const void* address) const;
  // Whether the object's own dynamic symbol table defines `symbol` (an import of it does
  // not count). Looks it up through DT_GNU_HASH or DT_HASH; false if neither exists.
  bool defines(std::string_view symbol) const;

 private:
  friend struct ObjectScan;
  std::string path_;
  uintptr_t base_ = 0;
  const void* phdrs_ = nullptr;  // ElfW(Phdr)*
  size_t phnum_ = 0;
  const void* symtab_ = nullptr;  // ElfW(Sym)*
  const char* strtab_ = nullptr;
  size_t strsz_ = 0;
  const uint32_t* gnu_hash_ = nullptr;
  const uint32_t* sysv_hash_ = nullptr;  // ElfW(Word) is 32 bits on both 64-bit targets
};

// What one object's imports came to. Only objects with at least one matching slot appear.
struct ObjectRebinds {
  std::string path;                 // "" for the main program
  size_t rewritten = 0;             // slots now pointing at a replacement that did not before
  size_t already = 0;               // slots that already pointed at their replacement
  std::vector<std::string> names;   // the wanted names it imports, as first found
};

struct RebindReport {
  size_t objects_scanned = 0;  // objects whose relocations were read (skipped ones excluded)
  size_t objects_skipped = 0;  // by the predicate
  std::vector<ObjectRebinds> objects;
  // Per entry of `wanted`: slots found bound to that name (rewritten + already) in all
  // scanned objects. 0 means no scanned object imports it through a GOT slot.
  std::vector<size_t> imports;
  // Objects that could not be read or written (a malformed dynamic section, an mprotect
  // that failed), one line each; the other objects were still processed.
  std::vector<std::string> errors;

  size_t rewritten() const;
};

// Objects the predicate returns true for are left alone (their own definitions, NCCL
// itself, the vdso). Never throws: failures are in the report's errors (an allocation
// failure too, as one line).
RebindReport rebind_imports(const std::vector<Rebinding>& wanted,
                            const std::function<bool(const LoadedObject&)>& skip) noexcept;

}  // namespace lgreco::net

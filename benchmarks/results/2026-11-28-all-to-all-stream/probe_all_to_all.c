#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N (16777216L)   /* piece bytes: half of 33.6 MB */
__attribute__((target("avx"))) static void cp(void*d,const void*s,size_t n){ char*D=d;const char*S=s; size_t i=0; for(;i+64<=n;i+=64){
 __m256i a=_mm256_loadu_si256((void*)(S+i)),b=_mm256_loadu_si256((void*)(S+i+32));
 _mm256_storeu_si256((void*)(D+i),a);_mm256_storeu_si256((void*)(D+i+32),b);} memcpy(D+i,S+i,n-i);}
__attribute__((target("avx"))) static void nt(void*d,const void*s,size_t n){ char*D=d;const char*S=s; size_t i=0; for(;i+64<=n;i+=64){
 __m256i a=_mm256_loadu_si256((void*)(S+i)),b=_mm256_loadu_si256((void*)(S+i+32));
 _mm256_stream_si256((void*)(D+i),a);_mm256_stream_si256((void*)(D+i+32),b);} memcpy(D+i,S+i,n-i); _mm_sfence(); }
static void nt_sse(void*d,const void*s,size_t n){ char*D=d;const char*S=s; size_t i=0; for(;i+64<=n;i+=64){
 __m128i a=_mm_loadu_si128((void*)(S+i)),b=_mm_loadu_si128((void*)(S+i+16)),c=_mm_loadu_si128((void*)(S+i+32)),e=_mm_loadu_si128((void*)(S+i+48));
 _mm_stream_si128((void*)(D+i),a);_mm_stream_si128((void*)(D+i+16),b);_mm_stream_si128((void*)(D+i+32),c);_mm_stream_si128((void*)(D+i+48),e);} memcpy(D+i,S+i,n-i); _mm_sfence(); }
struct Ctl { volatile long posted[2][16]; };
int main(int argc,char**argv){
  size_t slot = (argc>1? atol(argv[1]):512)*1024; int own_mode = argc>2? atoi(argv[2]):0; int collect_mode = argc>3?atoi(argv[3]):1;
  struct Ctl* c = mmap(0,4096,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  char* bufs = mmap(0,4*slot,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0); memset(bufs,0,4*slot);
  int r = fork()==0 ? 1 : 0, p=1-r;
  char* in = aligned_alloc(4096,2*N); char* out = aligned_alloc(4096,2*N); memset(in,r+1,2*N); memset(out,0,2*N);
  long posts=0;
  #define POST() do{ posts++; __atomic_store_n(&c->posted[r][0],posts,__ATOMIC_RELEASE);}while(0)
  #define WAIT(t) do{ while(__atomic_load_n(&c->posted[p][0],__ATOMIC_ACQUIRE)<(t)) _mm_pause(); }while(0)
  double all[31];
  for(int it=0;it<31;it++){
    POST(); WAIT(posts);
    double t=now();
    long rounds = N/slot;
    for(long k=0;k<rounds;k++){
      int b = k&1;
      if(k>=2) WAIT(posts-2);   /* peer done reading my buffer b from round k-2 */
      char* mine = bufs + (r*2+b)*slot; char* theirs = bufs + (p*2+b)*slot;
      cp(mine, in + p*N + k*slot, slot);
      POST();
      if(own_mode==0) memmove(out + r*N + k*slot, in + r*N + k*slot, slot);
      else if(own_mode==1) nt(out + r*N + k*slot, in + r*N + k*slot, slot);
      WAIT(posts);
      if(collect_mode==0) cp(out + p*N + k*slot, theirs, slot); else if(collect_mode==1) nt_sse(out+p*N+k*slot, theirs, slot); else nt(out+p*N+k*slot, theirs, slot);
      POST();
    }
    if(own_mode==2) nt(out + r*N, in + r*N, N);
    POST(); WAIT(posts);
    all[it]=now()-t;
  }
  for(int i=0;i<31;i++)for(int j=i+1;j<31;j++) if(all[j]<all[i]){double x=all[i];all[i]=all[j];all[j]=x;}
  if(r==0) printf("slot %zuK own %d collect %d: best %.2f median %.2f ms  (check %d %d)\n", slot/1024, own_mode, collect_mode, all[0]*1e3, all[15]*1e3, out[5], out[N+5]);
  if(r==1) return 0; wait(0); return 0;
}
